"""The main job's fast path: two short training runs agree and the fused one is smaller."""

import json

from torch_fce.__main__ import main


def test_main_job_tiny(tmp_path):
    main(["--steps", "3", "--tiny", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "main.json").read_text())
    runs = record["runs"]
    assert runs["torch_fce"]["fused"] == 1
    assert len(runs["unfused"]["losses"]) == len(runs["torch_fce"]["losses"]) == 3
    assert record["max_rel_loss_diff"] <= 1e-5
    assert runs["torch_fce"]["peak_mib"] < runs["unfused"]["peak_mib"]

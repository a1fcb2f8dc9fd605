"""The main job's fast path, as a user runs it (its own process: the resident-set peak
it measures on CPU is only meaningful in a fresh process)."""

import importlib.util
import json
import subprocess
import sys

import pytest


def test_main_job_tiny(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch_fce", "--steps", "3", "--tiny",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    # the PNG where matplotlib is installed, and the job says which it wrote
    has_png = (tmp_path / "main.png").exists()
    assert has_png == (importlib.util.find_spec("matplotlib") is not None)
    assert ("and main.png" in out.stdout) == has_png
    record = json.loads((tmp_path / "main.json").read_text())
    runs = record["runs"]
    assert runs["torch_fce"]["fused"] == 1
    assert len(runs["unfused"]["losses"]) == len(runs["torch_fce"]["losses"]) == 3
    assert record["max_rel_loss_diff"] <= 1e-5
    assert 0 < runs["torch_fce"]["peak_mib"] < runs["unfused"]["peak_mib"]
    assert record["ratios"]["peak"] == runs["torch_fce"]["peak_mib"] / runs["unfused"]["peak_mib"]
    q1, q3 = runs["torch_fce"]["step_ms_quartiles"]
    assert q1 <= runs["torch_fce"]["step_ms"] <= q3
    # Inductor's own chunker (torch >= 2.10) trains the same loss in less than the
    # unfused step's memory, and the job sets torch_fce against it too
    chunked = runs["auto_chunker"]
    assert chunked["fused"] == 0 and len(chunked["losses"]) == 3
    assert max(abs(x - y) / abs(x) for x, y in zip(runs["unfused"]["losses"],
                                                   chunked["losses"])) <= 1e-5
    assert 0 < chunked["peak_mib"] < runs["unfused"]["peak_mib"]
    assert record["ratios_vs_auto_chunker"]["peak"] == \
        runs["torch_fce"]["peak_mib"] / chunked["peak_mib"]
    assert "against Inductor's auto_chunker" in out.stdout


def test_main_job_at_the_smallest_sizes_a_quick_try_uses(tmp_path):
    # A step this small allocates less than the CPU measurement resolves: the job says
    # so (no ratio of two unresolved figures), and finishes with its record.
    out = subprocess.run([sys.executable, "-m", "torch_fce", "--tiny", "--steps", "3",
                          "--batch", "1", "--seq", "16", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "main.json").read_text())
    peaks = [run["peak_mib"] for run in record["runs"].values()]
    if None in peaks:
        assert record["ratios"]["peak"] is None and "too small to measure" in out.stdout
    else:
        assert min(peaks) >= 1.0


def test_main_job_refuses_sizes_it_cannot_measure(capsys):
    # Each a usage error naming the flag (exit 2), before anything is trained (the
    # parser's checks, in this process: nothing runs past them).
    from torch_fce.__main__ import main

    for flags, flag in ((["--steps", "0"], "--steps"), (["--steps", "1"], "--steps"),
                        (["--tiny", "--batch", "0"], "--batch"), (["--seq", "1"], "--seq"),
                        (["--tiny", "--dim", "6"], "--dim"), (["--lr", "-1"], "--lr"),
                        (["--lr", "nan"], "--lr"), (["--device", "meta"], "--device"),
                        (["--out", "/proc/nope/x"], "--out"),
                        (["--vocab", "99999999999"], "--vocab")):
        with pytest.raises(SystemExit) as stop:
            main(flags)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and flag in err, (flags, err)


def test_main_job_verdict_names_a_memory_gain_only_where_the_peaks_show_one():
    # At --tiny sizes Inductor's chunker can take less memory than torch_fce: a slower
    # step is then not excused as "the gain is memory".
    from torch_fce.__main__ import _verdict

    def run(ms, peak):
        return dict(step_ms=ms, step_ms_quartiles=[ms * 0.98, ms * 1.02], peak_mib=peak)

    slower = {"auto_chunker": run(68.0, 19.0), "torch_fce": run(77.0, 24.9)}
    said = _verdict(slower, 77.0 / 68.0, True, "auto_chunker")
    assert "slower: 1.13x the auto_chunker one" in said and "memory" not in said
    assert "as it does for the auto_chunker step" in said
    smaller = {"unfused": run(68.0, 68.6), "torch_fce": run(77.0, 24.9)}
    assert "the gain there is memory" in _verdict(smaller, 77.0 / 68.0, True)
    level = {"unfused": run(77.5, 68.6), "torch_fce": run(77.0, 24.9)}
    assert _verdict(level, 77.0 / 77.5, True).endswith("On a CPU torch_fce's gain is memory.")
    level["torch_fce"]["peak_mib"] = None  # too small to measure: no claim
    assert "memory" not in _verdict(level, 77.0 / 77.5, True)
    assert "faster: 0.50x" in _verdict(smaller, 0.5, True)

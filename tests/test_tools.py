"""The tools' command lines, as a user first meets them: one benchmark entry with
subcommands, help with defaults (the main job's PNG: tests/test_main.py)."""

import json
import subprocess
import sys

import pytest
import torch


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=300)


_SUBS = ["shapes", "lowering", "transformers", "distributed", "grpo", "sft", "distill"]
# (python -m) command lines that stop at their parser: their help, usage errors (--device
# cuda only on a CPU build of torch: with a GPU it runs the tool whole)
_COMMANDS = [("torch_fce.bench",), ("torch_fce.bench", "nope"), ("torch_fce", "--help"),
             *(("torch_fce.bench", sub, "--help") for sub in _SUBS),
             *([] if torch.cuda.is_available() else [
                 ("torch_fce", "--device", "cuda"),
                 ("torch_fce.bench", "shapes", "--device", "cuda"),
                 ("torch_fce.bench", "lowering", "--device", "cuda")])]
_ONE_PROCESS = """
import contextlib, io, json, runpy, sys
out = []
for module, *argv in json.loads(sys.argv[1]):
    sys.argv = [module, *argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out.append((code, stdout.getvalue(), stderr.getvalue()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli():
    """Each of _COMMANDS as `python -m` runs it, all in one fresh process (torch imported
    once): {command: (exit code, stdout, stderr)}."""
    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, json.dumps(_COMMANDS)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return dict(zip(_COMMANDS, json.loads(out.stdout.splitlines()[-1])))


def test_bench_lists_its_subcommands(cli):
    code, stdout, _ = cli["torch_fce.bench",]
    assert code == 2
    for sub in _SUBS:
        assert sub in stdout
    assert cli["torch_fce.bench", "nope"][0] == 2


def _parser_of(main, monkeypatch):
    """The argparse parser main() builds (its parse_args is stopped before it runs)."""
    import argparse

    seen = []

    def stop(self, *args, **kwargs):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        main([])
    return seen[0]


@pytest.mark.parametrize("sub", ["shapes", "lowering", "transformers", "distributed",
                                 "grpo", "sft", "distill", "main job"])
def test_every_option_with_a_default_names_it_in_its_help(sub, monkeypatch, cli):
    import importlib

    from torch_fce.bench.__main__ import SUBCOMMANDS

    name = "torch_fce.__main__" if sub == "main job" else \
        f"torch_fce.bench.{SUBCOMMANDS[sub][0]}"
    parser = _parser_of(importlib.import_module(name).main, monkeypatch)
    for action in parser._actions:
        if action.default in (None, False, "==SUPPRESS==") or not action.option_strings:
            continue
        assert action.help and "default" in action.help, (sub, action.option_strings)
    assert cli[("torch_fce", "--help") if sub == "main job" else
               ("torch_fce.bench", sub, "--help")][0] == 0


def test_main_job_help_names_defaults(cli):
    code, stdout, _ = cli["torch_fce", "--help"]
    assert code == 0 and "(default: 30)" in stdout


def test_bench_shapes_tiny_writes_its_rows(tmp_path):
    out = _run("torch_fce.bench", "shapes", "--shapes", "tiny", "--reps", "1", "--methods",
               "torch,fce-fp32", "--json", str(tmp_path / "rows.json"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"torch", "fce-fp32"}
    assert out.stdout.startswith("# ") and "{" not in out.stdout.splitlines()[0]


def test_bench_shapes_runs_inductors_chunker(tmp_path):
    # the peer a user who compiles already has: the unfused loss under Inductor's
    # auto_chunker, chunked in the compiled graph (a fraction of eager's memory), exact;
    # float32 on every device (the errors are against float32's composition: CUDA's
    # default bf16 would measure bf16's rounding)
    out = _run("torch_fce.bench", "shapes", "--shapes", "1024:64:8192", "--reps", "1",
               "--dtype", "float32",
               "--compile", "--methods", "torch,torch.compile-chunker", "--json",
               str(tmp_path / "rows.json"))
    assert out.returncode == 0, out.stderr
    rows = {r["method"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    chunked = rows["torch.compile-chunker"]
    assert chunked["extra_mib"] < rows["torch"]["extra_mib"] / 4
    assert max(chunked["loss_err"], chunked["dE_err"], chunked["dW_err"]) <= 1e-5


_PATCHED_STEP = """
import torch, transformers
from torch_fce.integrations import transformers as fce_hf
config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2)
model = fce_hf.apply(transformers.LlamaForCausalLM(config).train())
ids = torch.randint(0, 64, (1, 8))
model(input_ids=ids, labels=ids).loss.backward()
"""


def test_patched_transformers_forward_warns_nothing():
    # transformers logs its deprecations once per process: a fresh one, stderr read whole.
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-W", "always", "-c", _PATCHED_STEP],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "deprecated" not in out.stderr, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build of torch")
@pytest.mark.parametrize("tool", [("torch_fce",), ("torch_fce.bench", "shapes"),
                                  ("torch_fce.bench", "lowering")])
def test_device_cuda_on_a_cpu_build_is_a_usage_error(tool, cli):
    code, _, stderr = cli[(*tool, "--device", "cuda")]
    assert code == 2 and "--device cuda" in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("objective", ["logprobs", "policy"])
def test_bench_shapes_rl_objectives_write_their_rows(objective, tmp_path):
    out = _run("torch_fce.bench", "shapes", "--device", "cpu", "--shapes", "tiny", "--reps",
               "1", "--objective", objective, "--json", str(tmp_path / "rows.json"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"torch", "fce-fp32", "fce-input", "fce-f32logits"}
    # the same objective: torch_fce's loss and gradients are the float32 composition's
    # (the errors named: the GPU tier's run at 750bc9f failed this once, unseen since)
    assert all(r["loss_err"] < 1e-5 and r["dW_err"] < 1e-5 for r in rows), [
        (r["method"], r["loss_err"], r["dW_err"]) for r in rows]


def test_bench_grpo_tiny_runs_both_losses_and_they_agree():
    pytest.importorskip("trl")
    out = _run("torch_fce.bench", "grpo", "--device", "cpu", "--V", "512", "--D", "64",
               "--B", "4", "--P", "8", "--K", "32", "--reps", "1")
    assert out.returncode == 0, out.stderr[-4000:]
    last = out.stdout.strip().splitlines()[-1]
    assert "torch_fce / trl time" in last
    assert float(last.split("head gradient ")[1]) < 1e-5  # float32 on the CPU


def test_bench_sft_tiny_runs_every_loss_and_they_agree():
    pytest.importorskip("trl")
    out = _run("torch_fce.bench", "sft", "--device", "cpu", "--V", "512", "--D", "64",
               "--B", "2", "--T", "32", "--P", "4", "--reps", "1")
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if "torch_fce / trl time" in ln]
    assert [ln.split()[0] for ln in lines] == ["nll", "dft", "smooth"]
    for line in lines:  # float32 on the CPU
        assert float(line.split("loss difference ")[1].split()[0]) < 1e-5, line
        assert float(line.split("head gradient ")[1]) < 1e-5, line


def test_bench_distill_tiny_runs_and_agrees_with_trl():
    pytest.importorskip("trl")
    out = _run("torch_fce.bench", "distill", "--device", "cpu", "--N", "64", "--V", "300",
               "--Dt", "24", "--student-dims", "16", "--betas", "0,0.5", "--reps", "1",
               "--methods", "fce,eager,trl", "--teacher-dims", "24", "--ks", "1,7",
               "--supports", "5", "--sparse-betas", "0.5")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [dict(kv.split("=") for kv in ln.split()) for ln in out.stdout.splitlines()
            if ln.strip().startswith(("method=", "part="))]
    assert [(r.get("part"), r["method"]) for r in rows] == [
        (None, m) for b in ("0", "0.5") for m in ("fce", "eager", "trl")] + [
        ("topk", m) for k in (1, 7) for m in ("fce", "eager")] + [
        ("sparse", m) for tail in (0, 1) for m in ("fce", "eager")]  # --methods' own
    for r in rows:  # float32 on the CPU: every method's gradients on the reference's
        if "dw_err" in r:
            assert float(r["dw_err"]) < 1e-4 and float(r["dh_err"]) < 1e-4, r
        if "same_classes" in r:  # float32 logits both: the same top-k
            assert r["same_classes"] == "1", r
    assert sum("dw_err" in r for r in rows) == 6 + 2 * 2


def _usage_error(argv, named, capsys):
    """The bench's main on argv exits with a usage error naming `named` (in this
    process: its parser's checks run before anything is measured)."""
    from torch_fce.bench.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and named in err, (argv, err)


def test_bench_distill_names_bad_flags(capsys):
    for flags, named in ((["--methods", "fce,nope"], "--methods"), (["--betas", "2"], "--betas"),
                         (["--reps", "0"], "--reps"), (["--student-dims", "x"], "--student"),
                         (["--parts", "topk,x"], "--parts"), (["--ks", "300"], "--ks"),
                         (["--sparse-betas", "-1"], "--sparse-betas")):
        _usage_error(["distill", "--device", "cpu", *flags], named, capsys)


def test_bench_sft_names_bad_flags(capsys):
    for flags, named in ((["--losses", "nll,kl"], "--losses"), (["--P", "32"], "--P"),
                         (["--reps", "0"], "--reps")):
        _usage_error(["sft", "--device", "cpu", "--T", "32", *flags], named, capsys)


def test_bench_shapes_fails_when_torch_fce_fails(tmp_path, monkeypatch):
    import torch_fce
    from torch_fce.bench import shapes

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(torch_fce, "linear_cross_entropy", broken)
    png = tmp_path / "plot.png"
    with pytest.raises(SystemExit, match="torch_fce failed .*fce-fp32 on tiny"):
        shapes.main(["--device", "cpu", "--shapes", "tiny", "--reps", "1", "--methods",
                     "torch,fce-fp32", "--plot", str(png)])
    assert not png.exists()


def test_bench_sweep_workspace_covers_the_backward():
    # The log-probs' backward recomputes the logits: it must cut them as the forward did.
    from torch_fce.bench import measure, peers
    from torch_fce.ops.loop import workspace

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            seen.append(workspace._nbytes)
            return h.sum()

        @staticmethod
        def backward(ctx, g):
            seen.append(workspace._nbytes)
            return g.expand(3)

    def fn(h, w, target):
        return Spy.apply(h) + 0 * w.sum()

    x = dict(hidden=torch.ones(3), weight=torch.ones(2), target=None)
    peers.run_step(measure.with_workspace(fn, 5), x)
    assert seen == [5 << 20] * 2 and workspace._nbytes is None


# The GPU tier (README): the main job and every bench subcommand, as a user runs them.
CUDA_TOOLS = {
    "main job": ("torch_fce", "--device", "cuda", "--tiny", "--steps", "3"),
    "bench shapes": ("torch_fce.bench", "shapes", "--device", "cuda", "--shapes", "tiny",
                     "--reps", "1", "--methods", "torch,fce-fp32,fce-kahan,fce-input"),
    "bench shapes logprobs": ("torch_fce.bench", "shapes", "--device", "cuda", "--shapes",
                              "tiny", "--reps", "1", "--objective", "logprobs"),
    "bench shapes policy": ("torch_fce.bench", "shapes", "--device", "cuda", "--shapes",
                            "tiny", "--reps", "1", "--objective", "policy", "--compile"),
    "bench lowering": ("torch_fce.bench", "lowering", "--device", "cuda", "--V", "4096",
                       "--B", "2", "--T", "128"),
    "bench transformers": ("torch_fce.bench", "transformers", "--device", "cuda", "--V",
                           "8192", "--T", "256"),
    "bench grpo": ("torch_fce.bench", "grpo", "--device", "cuda", "--V", "4096", "--D",
                   "256", "--B", "4", "--P", "16", "--K", "128", "--reps", "1"),
    "bench sft": ("torch_fce.bench", "sft", "--device", "cuda", "--V", "4096", "--D", "256",
                  "--B", "2", "--T", "128", "--reps", "1"),
    "bench distill": ("torch_fce.bench", "distill", "--device", "cuda", "--N", "512", "--V",
                      "4096", "--Dt", "256", "--student-dims", "128", "--betas", "0,0.5",
                      "--reps", "1", "--methods", "fce,fce-bf16logits,compile,trl",
                      "--teacher-dims", "256", "--ks", "8", "--supports", "8"),
    # one GPU: NCCL with one rank (two ranks: tests/distributed/test_vocab_parallel_nccl.py)
    "bench distributed": ("torch_fce.bench", "distributed", "--world", "1", "--device",
                          "cuda", "--shapes", "tiny", "--reps", "1"),
    "bench distributed sparse": ("torch_fce.bench", "distributed", "--world", "1",
                                 "--device", "cuda", "--shapes", "tiny", "--reps", "1",
                                 "--op", "sparse"),
    "bench distributed topk": ("torch_fce.bench", "distributed", "--world", "1", "--device",
                               "cuda", "--shapes", "tiny", "--reps", "1", "--op", "topk"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_TOOLS)
def test_tools_run_on_cuda(name, tmp_path):
    args = CUDA_TOOLS[name] + (("--out", str(tmp_path)) if name == "main job" else ())
    out = _run(*args)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "failed" not in out.stderr, out.stderr[-4000:]


_ALLOCATOR = """
import ctypes, json, torch
from torch_fce.bench import measure


class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd "
                                               "usmblks fsmblks uordblks fordblks "
                                               "keepcost").split()]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info


def mapped_by(fn):  # the bytes malloc holds in mmapped blocks while fn's buffer lives
    before = libc.mallinfo2().hblkhd
    buffer = fn()
    return libc.mallinfo2().hblkhd - before


def chunk():  # a 16 MiB buffer: a logits chunk's size
    return torch.ones(4 << 20)


measure.prepare("cpu")  # the memory figures' malloc: each large buffer mapped anew
pinned = mapped_by(chunk)
with measure.users_allocator("cpu"):
    users = mapped_by(chunk)
print(json.dumps(dict(pinned=pinned, users=users)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_timings_run_with_malloc_as_users_have_it():
    # The memory figures have malloc map each large buffer anew (so freed memory leaves
    # the resident set); the main job's timings run in users_allocator, where a
    # chunk-sized buffer comes from malloc's heap, as in a user's process.
    out = subprocess.run([sys.executable, "-c", _ALLOCATOR], capture_output=True,
                         text=True, timeout=300)
    if "undefined symbol: mallinfo2" in out.stderr:
        pytest.skip("glibc < 2.33: no mallinfo2")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["pinned"] >= 16 << 20 and got["users"] == 0

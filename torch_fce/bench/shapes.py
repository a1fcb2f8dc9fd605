"""python -m torch_fce.bench shapes: fused linear + cross-entropy, methods x shapes.

The benchmark by job: shapes and the timed runs here (with the CLI and the isolation of
each method in a process of its own); the methods in peers.py, the accuracy study in
accuracy.py, the figures in plots.py, the machine's record in env.py.

Per method: forward+backward median time, the time of one (N, D) x (D, V) matmul in the
same run and the ratio, peak memory beyond inputs and gradients, and the relative L2
error of loss, dE (hidden gradient) and dW (weight gradient) against a float32
reference computed from the same inputs. Prints one table; --json writes the rows with
the machine, versions and git SHA; --plot writes PNG bar charts (needs matplotlib).
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys

import torch

from torch_fce.bench import rl
from torch_fce.bench.accuracy import accuracy, print_accuracy
from torch_fce.bench.env import describe, environment
from torch_fce.bench.measure import (add_device_option, check_device, median_time,
                                     peak_extra_bytes, times)
from torch_fce.bench.peers import (QUACK_CHUNKS, SWEEP_WORKSPACE_MIB, methods, reference,
                                   run_step)
from torch_fce.bench.plots import plot, plot_tradeoff
from torch_fce.testing import make_inputs, rel_err


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    N: int
    D: int
    V: int


SHAPES = {
    "cpu": Shape("cpu", 8192, 512, 32000),
    "tiny": Shape("tiny", 256, 64, 1000),
    "A": Shape("A", 16384, 4096, 128256),
    "B": Shape("B", 8192, 2304, 256000),
    "C": Shape("C", 32768, 4096, 151936),
    # The small heads RL trains: Qwen2.5-0.5B and 1.5B, Qwen3-0.6B and 1.7B.
    "D": Shape("D", 16384, 896, 151936),
    "E": Shape("E", 16384, 1536, 151936),
    "Q1024": Shape("Q1024", 16384, 1024, 151936),
    "Q2048": Shape("Q2048", 16384, 2048, 151936),
}


@dataclasses.dataclass(frozen=True)
class Result:
    shape: str
    N: int
    D: int
    V: int
    dtype: str
    method: str
    ms: float
    mm_ms: float
    x_mm: float
    extra_mib: float
    loss_err: float
    dE_err: float
    dW_err: float
    # the spread of the timed repetitions (ms): timings move between runs
    ms_min: float = float("nan")
    ms_max: float = float("nan")


def _skip(name, shape):
    """Why a method cannot run on a shape (None if it can): quack's measured limits."""
    if not name.startswith("quack-"):
        return None
    chunk = int(name.rsplit("-", 1)[1])
    if chunk == shape.D:
        return "quack fails when chunk_size equals D"
    if chunk >= shape.N:
        return "quack with one chunk of N ran for minutes on shape A"
    return None


def shape_inputs(shape, dtype=torch.bfloat16, device="cuda"):
    """The benchmark's inputs of a shape, for this tool, bench distributed and the probes:
    hidden ~ randn/sqrt(D), weight ~ 2 randn, 1 in 17 targets ignored."""
    return make_inputs(shape.N, shape.D, shape.V, dtype, device=device, weight_scale=2.0)


def bench_shape(shape, dtype, device, fns, reps, progress, objective="ce", failed=None):
    """Rows of every method on one shape; the methods that raised are appended to
    failed."""
    x = shape_inputs(shape, dtype, device)
    if objective == "policy":
        x["data"] = rl.policy_data(x["hidden"], x["weight"], x["target"])
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = reference(x, objective=objective)
    torch.backends.cuda.matmul.allow_tf32 = old_tf32
    mm = median_time(lambda: x["hidden"] @ x["weight"].T, device, reps=reps)
    rows = []
    for name, fn in fns.items():
        progress(f"{shape.name} {name}")
        if _skip(name, shape):
            print(f"  {name} skipped on {shape.name}: {_skip(name, shape)}", file=sys.stderr)
            continue
        if name.startswith("quack"):
            # Its first call per shape autotunes two GEMMs (44 configs x 254 launches
            # each; about 5 minutes on shape A with an empty cache); results persist in
            # QUACK_CACHE_DIR, and QUACK_PRINT_AUTOTUNING=1 shows the progress.
            print(f"  {name}: quack autotunes on its first call per shape (minutes with "
                  "an empty cache; QUACK_CACHE_DIR keeps the results)", file=sys.stderr)
        try:
            out = run_step(fn, x)  # warm-up (compiles) and the error sample
            ts = times(lambda: run_step(fn, x), device, reps=reps, warmup=1)
            t = statistics.median(ts)
            # Gradients are the caller's; what a method holds beyond them is its cost.
            grads = x["hidden"].numel() + x["weight"].numel()
            mem = peak_extra_bytes(lambda: run_step(fn, x), device)
            mem -= grads * x["hidden"].element_size()
        except Exception as e:  # a peer failing on a shape is a result, not a crash
            print(f"  {name} failed on {shape.name}: {type(e).__name__}: {e}", file=sys.stderr)
            if failed is not None:
                failed.append(f"{name} on {shape.name}")
            continue
        errs = [rel_err(a, b) for a, b in zip(out, ref)]
        rows.append(Result(shape.name, shape.N, shape.D, shape.V, str(dtype).split(".")[-1],
                           name, t * 1e3, mm * 1e3, t / mm, max(mem, 0) / 2**20, *errs,
                           min(ts) * 1e3, max(ts) * 1e3))
        progress(f"  -> {t / mm:.2f} x mm, {max(mem, 0) / 2**20:.0f} MiB extra", step=False)
        del out
    return rows


def print_table(rows):
    head = f"{'shape':6} {'method':21} {'ms':>9} {'min-max ms':>17} {'x mm':>6} " \
           f"{'extra MiB':>10} {'loss err':>9} {'dE err':>8} {'dW err':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        spread = f"{r.ms_min:.2f}-{r.ms_max:.2f}"
        print(f"{r.shape:6} {r.method:21} {r.ms:9.2f} {spread:>17} {r.x_mm:6.2f} "
              f"{r.extra_mib:10.1f} {r.loss_err:9.2e} {r.dE_err:8.2e} {r.dW_err:8.2e}")


def _isolated(args, shapes, names):
    """Runs each method in a process of its own (fresh allocator, JIT caches, peak
    memory) and gathers the rows."""
    import tempfile

    rows = []
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "torch_fce.bench", "shapes", "--device", args.device,
                   "--shapes", ",".join(shapes), "--methods", name, "--reps",
                   str(args.reps), "--json", f.name]
            cmd += ["--dtype", args.dtype] if args.dtype else []
            cmd += ["--compile"] if name.startswith("torch.compile") else []
            cmd += ["--sweep", ",".join(map(str, args.sweep))] if args.sweep else []
            cmd += ["--objective", args.objective]
            if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
                print(f"  {name}: its process failed", file=sys.stderr)
                continue
            rows += [Result(**r) for r in json.load(f)["rows"]]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_fce.bench shapes", description=__doc__)
    add_device_option(p)
    p.add_argument("--shapes", default=None,
                   help="comma-separated names from %s or N:D:V (default: A,B,C on "
                        "CUDA, cpu on CPU)" % ",".join(SHAPES))
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU)")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of: torch, torch.compile and "
                        "torch.compile-chunker (Inductor's auto_chunker; with --compile), "
                        "liger, cce, cce-exact, quack-{base,fused}-{4096,8192} (CUDA, where "
                        "installed), fce-{fp32,kahan,input}, fce-f32logits "
                        "(logits_dtype=torch.float32), fce-exp (the exp-GEMM pipeline, ce and "
                        "policy, on an sm_90 GPU with quack-kernels), fce-fp32@MiB (with --sweep) "
                        "(default: all available)")
    p.add_argument("--compile", action="store_true",
                   help="include torch.compile, as is and with Inductor's auto_chunker")
    p.add_argument("--objective", choices=("ce", "logprobs", "policy"), default="ce",
                   help="ce: the mean cross entropy; logprobs: sum of random per-token "
                        "weights times log-probs and entropies at temperature %s (fce: "
                        "torch_fce.linear_logprobs); policy: the DAPO loss + beta %s k3 KL "
                        "(fce: torch_fce.linear_policy_loss); both with TRL's fused head "
                        "on CUDA (torch_fce/bench/rl.py) (default: ce)" % (rl.TEMPERATURE, rl.BETA))
    p.add_argument("--reps", type=int, default=5,
                   help="timed repetitions after one warm-up; the median is reported (default: 5)")
    p.add_argument("--accuracy", default=None,
                   help="comma-separated N for the error-vs-N study (D=256, V=2048, bf16), "
                        "e.g. 4096,65536,262144")
    p.add_argument("--sweep", nargs="?", default=None, const=SWEEP_WORKSPACE_MIB,
                   type=lambda v: tuple(int(m) for m in v.split(",")),
                   help="time-memory sweep: torch_fce fp32 at workspaces of these "
                        "comma-separated MiB (alone: %s) besides quack's chunks %s; with "
                        "--plot also writes *_tradeoff.png"
                        % (",".join(map(str, SWEEP_WORKSPACE_MIB)), QUACK_CHUNKS))
    p.add_argument("--isolate", action="store_true",
                   help="one process per method (peak memory and JIT caches of its own)")
    p.add_argument("--json", default=None, help="write rows + environment here")
    p.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    check_device(p, args.device)
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    names = [n for n in (args.shapes or ("A,B,C" if cuda else "cpu")).split(",") if n]
    shapes = [SHAPES[n] if n in SHAPES else Shape(n, *map(int, n.split(":"))) for n in names]
    fns = rl.methods(args.objective, args.device, args.compile, args.sweep or ()) \
        if args.objective != "ce" else methods(args.device, args.compile, args.sweep or ())
    if args.methods:
        fns = {k: v for k, v in fns.items() if k in args.methods.split(",")}
    total, done = len(shapes) * len(fns), [0]

    def progress(what, step=True):
        done[0] += step
        print(f"[{done[0]:3d}/{total}] {what}", file=sys.stderr, flush=True)

    env = environment()

    def save(rows, acc_rows=()):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(environment=env, rows=[dataclasses.asdict(r) for r in rows],
                               accuracy=[dataclasses.asdict(r) for r in acc_rows]), f,
                          indent=1)

    rows, failed = [], []
    if args.isolate:
        rows = _isolated(args, names, list(fns))
        failed = [f"{n} on {s}" for n in fns for s in names
                  if not any(r.method == n and r.shape == s for r in rows)]
    else:
        for shape in shapes:
            rows += bench_shape(shape, dtype, args.device, fns, args.reps, progress,
                                args.objective, failed)
            save(rows)  # a run cut short keeps the shapes it finished
    acc_rows = []
    if args.accuracy:
        Ns = [int(n) for n in args.accuracy.split(",")]
        acc_fns = {k: v for k, v in fns.items() if not k.startswith("torch.compile")}
        total += len(Ns) * len(acc_fns)
        acc_rows = accuracy(acc_fns, args.device, Ns, progress=progress)
    print(f"# {describe(env)}")
    print_table(rows)
    if acc_rows:
        print_accuracy(acc_rows)
    save(rows, acc_rows)
    # A peer failing is a result; torch_fce failing is this tool's failure: no plot.
    ours = [f for f in failed if f.startswith("fce")]
    if ours:
        sys.exit(f"error: torch_fce failed ({', '.join(ours)}); see the messages above")
    if args.plot:
        plot(rows, acc_rows, args.plot, describe(env))
        if args.sweep and rows:
            plot_tradeoff(rows, args.plot.replace(".png", "_tradeoff.png"), describe(env))
    return rows, acc_rows


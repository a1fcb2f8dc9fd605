"""python -m torch_fce.bench shapes: fused linear + cross-entropy, methods x shapes.

Per method: forward+backward median time, the time of one (N, D) x (D, V) matmul in the
same run and the ratio, peak memory beyond inputs and gradients, and the relative L2
error of loss, dE (hidden gradient) and dW (weight gradient) against a float32
reference computed from the same inputs. Prints one table; --json writes the rows with
the machine, versions and git SHA; --plot writes PNG bar charts (needs matplotlib).
"""

import argparse
import contextlib
import os
import dataclasses
import json
import platform
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench import rl
from torch_fce.bench.measure import (add_device_option, check_device, median_time,
                                     peak_extra_bytes, times, with_workspace)
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


def _torch_unfused(h, w, t):
    # As HF: logits in the input dtype, upcast to float32 for the loss.
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def _fce(accumulator):
    return lambda h, w, t: torch_fce.linear_cross_entropy(h, w, t, accumulator=accumulator)


def _liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda h, w, t: loss(w, h, t)


def _cce(impl=None):
    from cut_cross_entropy import linear_cross_entropy

    kw = {} if impl is None else dict(impl=impl)
    return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=-100, **kw)


def _quack(chunk, fused):
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    # use_scaled_exp: True is quack's fused SM90 pipeline, False its base one (None would
    # pick per shape, so both are named explicitly).
    return lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk, ignore_index=-100,
                                                        use_scaled_exp=fused)



# The time-memory sweep (--sweep): torch_fce's workspace and the peers' chunk sizes.
SWEEP_WORKSPACE_MIB = (256, 512, 1024, 2048, 4096)
QUACK_CHUNKS = (4096, 8192)


def _peers():
    """Peer name -> factory; factories raise where the peer is missing or cannot load."""
    out = {"liger": _liger, "cce": _cce, "cce-exact": lambda: _cce("cce_exact")}
    for chunk in QUACK_CHUNKS:
        for fused, label in ((False, "base"), (True, "fused")):
            out[f"quack-{label}-{chunk}"] = lambda c=chunk, f=fused: _quack(c, f)
    return out


def methods(device, with_compile, sweep=False):
    """Name -> loss function (hidden, weight, target) for every method available here.

    Peers (CUDA, where installed): Liger, CCE (default and cce_exact) and quack (base and
    fused pipelines at each chunk of QUACK_CHUNKS). sweep adds torch_fce fp32 at each
    workspace of SWEEP_WORKSPACE_MIB ("fce-fp32@MiB").
    """
    out = {"torch": _torch_unfused}
    if with_compile:
        out["torch.compile"] = torch.compile(_torch_unfused, fullgraph=True)
    if device == "cuda":
        for name, make in _peers().items():
            try:
                out[name] = make()
            except Exception as e:  # missing, or installed without its runtime
                print(f"  {name} unavailable: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    for acc in ("fp32", "kahan", "input"):
        out[f"fce-{acc}"] = _fce(acc)
    if sweep:
        for mib in SWEEP_WORKSPACE_MIB:
            out[f"fce-fp32@{mib}"] = with_workspace(_fce("fp32"), mib)
    return out


def _reference(x, dtype=torch.float32, objective="ce"):
    """Loss and gradients in dtype from the same (rounded) inputs, logits materialised."""
    h = x["hidden"].to(dtype).requires_grad_()
    w = x["weight"].to(dtype).requires_grad_()
    if objective == "logprobs":
        loss = rl.logprobs_unfused(h, w, x["target"])
    elif objective == "policy":
        loss = rl.policy_unfused(h, w, x["target"], *x["data"])
    else:
        loss = F.cross_entropy(F.linear(h, w), x["target"], ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _run(fn, x):
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    with getattr(fn, "workspace", contextlib.nullcontext)():  # measure.with_workspace
        loss = fn(h, w, x["target"], *x.get("data", ()))
        loss.backward()
    return loss.detach(), h.grad, w.grad


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
    ref = _reference(x, objective=objective)
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
            out = _run(fn, x)  # warm-up (compiles) and the error sample
            ts = times(lambda: _run(fn, x), device, reps=reps, warmup=1)
            t = statistics.median(ts)
            # Gradients are the caller's; what a method holds beyond them is its cost.
            grads = x["hidden"].numel() + x["weight"].numel()
            mem = peak_extra_bytes(lambda: _run(fn, x), device)
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


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.machine()
    return f"{model}, {torch.get_num_threads()} threads"


@dataclasses.dataclass(frozen=True)
class AccuracyResult:
    N: int
    D: int
    V: int
    method: str
    loss_err: float
    dE_err: float
    dW_err: float
    loss_api_err: float


def accuracy(fns, device, Ns, D=256, V=2048, progress=print):
    """Errors against a float64 reference from the same bf16 inputs, as N grows."""
    rows = []
    for N in Ns:
        x = make_inputs(N, D, V, torch.bfloat16, device=device, weight_scale=2.0)
        ref = _reference(x, torch.float64)
        # docs/api.md's formula rounds the logits to the input dtype before the float32 math.
        api_loss = F.cross_entropy(F.linear(x["hidden"], x["weight"]).double(), x["target"],
                                   ignore_index=-100)
        for name, fn in fns.items():
            progress(f"accuracy N={N} {name}")
            try:
                out = _run(fn, x)
            except Exception as e:
                print(f"  {name} failed at N={N}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            errs = [rel_err(a, b) for a, b in zip(out, ref)]
            rows.append(AccuracyResult(N, D, V, name, *errs, rel_err(out[0], api_loss)))
    return rows


def print_accuracy(rows):
    print(f"{'N':>7} {'method':14} {'loss err':>9} {'dE err':>8} {'dW err':>8} "
          f"{'loss err vs API formula':>24}")
    for r in rows:
        print(f"{r.N:7d} {r.method:14} {r.loss_err:9.2e} {r.dE_err:8.2e} {r.dW_err:8.2e} "
              f"{r.loss_api_err:24.2e}")


def environment():
    # TORCH_FCE_GIT_SHA names the commit where the checkout has no usable git metadata.
    sha = os.environ.get("TORCH_FCE_GIT_SHA", "")
    try:
        sha = sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(device=gpu, torch=torch.__version__, triton=triton_version, git=sha,
                python=platform.python_version())


def describe(env):
    """One readable line for an environment() record."""
    return (f"{env['device']}, torch {env['torch']}, triton {env['triton']}, "
            f"Python {env['python']}, git {env['git'] or 'unknown'}")


def print_table(rows):
    head = f"{'shape':6} {'method':14} {'ms':>9} {'min-max ms':>17} {'x mm':>6} " \
           f"{'extra MiB':>10} {'loss err':>9} {'dE err':>8} {'dW err':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        spread = f"{r.ms_min:.2f}-{r.ms_max:.2f}"
        print(f"{r.shape:6} {r.method:14} {r.ms:9.2f} {spread:>17} {r.x_mm:6.2f} "
              f"{r.extra_mib:10.1f} {r.loss_err:9.2e} {r.dE_err:8.2e} {r.dW_err:8.2e}")


def plot(rows, acc_rows, path, header):
    """Bar charts of rows (and the accuracy study's lines), each figure headed by the
    run's machine and versions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if acc_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in sorted({r.method for r in acc_rows}):
            pts = [(r.N, r.dW_err) for r in acc_rows if r.method == m]
            ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="dW rel. error vs float64")
        ax.legend(fontsize=7)
        fig.suptitle(header, fontsize=7)
        fig.tight_layout()
        fig.savefig(path.replace(".png", "_accuracy.png"), dpi=120)
    if not rows:
        return
    shapes = sorted({r.shape for r in rows}, key=[r.shape for r in rows].index)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, field, label in zip(axes, ("x_mm", "extra_mib", "dW_err"),
                                ("time / one matmul", "extra memory (MiB)", "dW rel. error")):
        names = sorted({r.method for r in rows}, key=[r.method for r in rows].index)
        width = 0.8 / len(names)
        for i, m in enumerate(names):
            vals = [next((getattr(r, field) for r in rows if r.shape == s and r.method == m),
                         0.0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_title(label)
        if field != "x_mm":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(header, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _family(method):
    """The curve a method's point belongs to in the time-memory plot."""
    if method.startswith("fce-fp32@"):
        return "fce-fp32 (workspace MiB)"
    if method.startswith("quack-"):
        return method.rsplit("-", 1)[0] + " (chunk)"
    return method


def plot_tradeoff(rows, path, header):
    """Time vs peak extra memory, one panel per shape, each sweep a labelled curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in rows}, key=[r.shape for r in rows].index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        here = [r for r in rows if r.shape == shape and r.method != "torch"]
        # Points far above the best would squash the curves: listed instead of drawn.
        best = min(r.x_mm for r in here)
        off = [r for r in here if r.x_mm > 1.6 * best]
        here = [r for r in here if r.x_mm <= 1.6 * best]
        if off:
            ax.text(0.02, 0.98, "off the chart: " + ", ".join(
                f"{r.method} {r.x_mm:.1f}x" for r in off), transform=ax.transAxes,
                fontsize=7, va="top")
        for fam in sorted({_family(r.method) for r in here}):
            pts = sorted((r.extra_mib, r.x_mm, r.method) for r in here
                         if _family(r.method) == fam)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=fam, linestyle="-" if len(pts) > 1 else "none")
            for x, y, m in pts:
                if "@" in m or m.startswith("quack-"):
                    ax.annotate(m.rsplit("@", 1)[-1].rsplit("-", 1)[-1], (x, y), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
        r0 = here[0]
        ax.set(xscale="log", xlabel="peak extra memory (MiB)", ylabel="time / one matmul",
               title=f"{shape} {r0.N}x{r0.D}x{r0.V}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(header, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
            cmd += ["--compile"] if name == "torch.compile" else []
            cmd += ["--sweep"] if args.sweep else []
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
                   help="comma-separated subset of: torch, torch.compile (with --compile), "
                        "liger, cce, cce-exact, quack-{base,fused}-{4096,8192} (CUDA, where "
                        "installed), fce-{fp32,kahan,input}, fce-fp32@MiB (with --sweep) "
                        "(default: all available)")
    p.add_argument("--compile", action="store_true", help="include torch.compile")
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
    p.add_argument("--sweep", action="store_true",
                   help="time-memory sweep: torch_fce fp32 at workspaces %s MiB besides "
                        "quack's chunks %s; with --plot also writes *_tradeoff.png"
                        % (SWEEP_WORKSPACE_MIB, QUACK_CHUNKS))
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
    fns = rl.methods(args.objective, args.device, args.compile,
                     SWEEP_WORKSPACE_MIB if args.sweep else ()) \
        if args.objective != "ce" else methods(args.device, args.compile, args.sweep)
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
        acc_fns = {k: v for k, v in fns.items() if k != "torch.compile"}
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


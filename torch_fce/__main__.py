"""python -m torch_fce: the main job — train a small causal LM unfused and fused.

A TinyLM (torch_fce/bench/tiny_lm.py, loss written the unfused way transformers writes it) is
trained with AdamW on text shipped in the package (its own docstrings, as word tokens
hashed into a large vocabulary), compiled with torch.compile: as is; with Inductor's own
chunker (torch._inductor.config.auto_chunker, torch >= 2.10: what a user who compiles
already has, which chunks the unfused loss inside the compiled graph); and with
torch_fce.lowering, which rewrites its loss into fce::linear_ce. Prints the losses per
step, their agreement, peak memory and step time; writes a JSON record and, with
matplotlib installed (the "plot" extra), a PNG.

The step time is the median of TIMED_STEPS steps of a fresh run of each (after two that
compile), with its quartiles, timed once every run has trained and its memory was
measured: on a CPU the memory figures have malloc map each large buffer anew, which a
user's process does not (bench/measure.py's users_allocator); a CPU shared with other
work moves single steps by tens of percent. On a CPU at the default size torch_fce's step
took 0.29x the unfused one's memory and 0.77x Inductor's chunker's at about their time
(README); on a GPU a model this small is launch-bound, and docs/benchmarks.md has the
real sizes.
"""

TIMED_STEPS = 15

import argparse
import ast
import contextlib
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import zlib

import torch
from torch._dynamo.utils import counters

import torch_fce
import torch_fce.lowering as lowering
from torch_fce.bench.env import describe, environment
from torch_fce.bench.measure import (AUTO_CHUNKER, check_device, has_auto_chunker, measured,
                                     peak_extra_bytes, prepare, users_allocator)
from torch_fce.bench.tiny_lm import TinyLM


def corpus_ids(vocab):
    """The package's docstrings as word tokens, hashed (crc32) into [0, vocab).

    Read from the sources with ast, not imported: a module of an optional extra (the CuTe
    kernels need quack) must not decide whether the job runs, nor what text it trains on.
    """
    text = []
    root = pathlib.Path(torch_fce.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        text.append(ast.get_docstring(tree) or "")
        text += [ast.get_docstring(node) or "" for node in tree.body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    words = re.findall(r"\w+|[^\w\s]", " ".join(text).lower())
    return torch.tensor([zlib.crc32(w.encode()) % vocab for w in words])


def batches(ids, batch, seq, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


RUNS = ("unfused", "auto_chunker", "torch_fce")


def _compile_mode(name, accumulator):
    """The context a run trains in: torch_fce's lowering, Inductor's chunker, or neither."""
    if name == "torch_fce":
        return lowering.auto_fuse(accumulator)
    if name == "auto_chunker":
        import torch._inductor.config as inductor_config
        return inductor_config.patch(AUTO_CHUNKER)
    return contextlib.nullcontext()


def _fresh_step(args):
    """A fresh, seeded run's training step (model, AdamW, torch.compile), compiled at
    its first call in the block it runs in."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(args.vocab, dim=args.dim, layers=args.layers, heads=4,
                   max_len=args.seq).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_fn = torch.compile(model)

    def step(x):
        loss = step_fn(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def _probe(args, ids):
    return next(batches(ids, args.batch, args.seq, 1, seed=1)).to(args.device)


def train(args, ids, name, progress):
    """A run's losses, the peak memory of one step after them and its fusions."""
    fused_before = counters["inductor"][lowering.FUSED]
    losses = []
    with lowering.fresh_compiles(), _compile_mode(name, args.accumulator):
        step = _fresh_step(args)
        for i, x in enumerate(batches(ids, args.batch, args.seq, args.steps)):
            losses.append(step(x.to(args.device)).item())
            progress(i + 1, args.steps, losses[-1])
        probe = _probe(args, ids)
        peak = peak_extra_bytes(lambda: step(probe), args.device)
    return dict(losses=losses, peak_mib=peak / 2**20 if measured(peak, args.device) else None,
                fused=counters["inductor"][lowering.FUSED] - fused_before)


def time_steps(args, ids, name):
    """A fresh run's step time (median and quartiles of TIMED_STEPS after two that
    compile), in users_allocator: run once every memory figure is taken, as the heap a
    timing leaves would hide memory from a later figure."""
    probe, times = _probe(args, ids), []
    with lowering.fresh_compiles(), _compile_mode(name, args.accumulator), \
            users_allocator(args.device):
        step = _fresh_step(args)
        for _ in range(2):
            step(probe)
        for _ in range(TIMED_STEPS):
            t0 = time.perf_counter()
            step(probe).item()  # .item(): the step's work is done
            times.append((time.perf_counter() - t0) * 1e3)
    q1, median, q3 = statistics.quantiles(times, n=4)
    return dict(step_ms=median, step_ms_quartiles=[q1, q3])


def _check_sizes(parser, args):
    """Usage errors naming the flag, before anything runs."""
    least = dict(steps=3, batch=1, seq=2, vocab=2, dim=4, layers=1)
    why = dict(steps="the first two steps compile; the step time is the median of the rest",
               seq="each sequence's last position has no next token to predict")
    for name, low in least.items():
        if getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}" + (f" ({why[name]})" if name in why
                                                         else "")
                         + f", got {getattr(args, name)}")
    if args.dim % 4:
        parser.error(f"--dim must be a multiple of 4 (4 attention heads), got {args.dim}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        parser.error(f"--lr must be a finite number >= 0 (AdamW's learning rate), got "
                     f"{args.lr}")
    if torch.device(args.device).type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda (a CUDA index allowed), got {args.device}")
    need, have = _bytes_needed(args), _device_bytes(args.device)
    if need > have:
        parser.error(f"--vocab {args.vocab} with --dim {args.dim}, --batch {args.batch} and "
                     f"--seq {args.seq} needs about {need / 2**30:.1f} GiB (the unfused run's "
                     f"float32 logits, their gradient and the head with AdamW's state), more "
                     f"than the {have / 2**30:.1f} GiB of {args.device}")
    try:  # written at the end: found unwritable now, not after the training
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        parser.error(f"--out {args.out}: cannot write there ({e.strerror or e})")


def _bytes_needed(args):
    """A lower bound of the unfused run's bytes: the (N, V) float32 logits and their
    gradient, the embedding and the head with their gradients and AdamW's two states."""
    return 4 * (2 * args.batch * args.seq * args.vocab + 2 * 4 * args.vocab * args.dim)


def _device_bytes(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _bar(name):
    """A progress bar on a terminal; on a log (not a TTY), a line every fifth of the run."""
    tty = sys.stderr.isatty()

    def progress(i, n, loss):
        if tty:
            filled = int(30 * i / n)
            print(f"\r{name:9} [{'#' * filled}{'.' * (30 - filled)}] {i}/{n} loss {loss:.4f}",
                  end="" if i < n else "\n", file=sys.stderr, flush=True)
        elif i == n or i % max(1, n // 5) == 0:
            print(f"{name:9} step {i}/{n} loss {loss:.4f}", file=sys.stderr, flush=True)
    return progress


def _ratios(runs, base="unfused"):
    """torch_fce's peak memory (None where a peak is below the resolution) and step
    time as multiples of the base run's."""
    a, b = runs[base], runs["torch_fce"]
    peak = None if None in (a["peak_mib"], b["peak_mib"]) else b["peak_mib"] / a["peak_mib"]
    return dict(peak=peak, time=b["step_ms"] / a["step_ms"])


def _verdict(runs, ratio, cpu, base="unfused"):
    """What the step times say: within their spread of each other, or which is faster,
    and why, as this device works (a memory gain named only where the peaks show one)."""
    a, b = runs[base], runs["torch_fce"]
    smaller = None not in (a["peak_mib"], b["peak_mib"]) and b["peak_mib"] < a["peak_mib"]
    if b["step_ms_quartiles"][0] <= a["step_ms_quartiles"][1] and \
            a["step_ms_quartiles"][0] <= b["step_ms_quartiles"][1]:
        return (f"torch_fce's and the {base} step times are within each other's quartiles: "
                "no measurable difference."
                + (" On a CPU torch_fce's gain is memory." if cpu and smaller else ""))
    if ratio < 1:
        return f"torch_fce's step is faster: {ratio:.2f}x the {base} one."
    why = (f"On a CPU its row math runs as plain PyTorch passes over each logits chunk, "
           f"which Inductor cannot fuse into the softmax as it does for the {base} step"
           + (": the gain there is memory." if smaller else ".") if cpu else
           "On a GPU a model this small is launch-bound (each chunk's GEMMs and row kernel "
           "are separate launches); at real sizes torch_fce is faster and smaller "
           "(docs/benchmarks.md).")
    return f"torch_fce's step is slower: {ratio:.2f}x the {base} one. {why}"


def plot(record, path):
    """Loss curves, their relative difference, peak memory and step time, with the
    machine and configuration in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, args, env = record["runs"], record["args"], record["environment"]
    names = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    steps = range(1, len(runs[names[0]]["losses"]) + 1)  # as the printed table: 1..N
    for name, style in zip(names, ("-", ":", "--")):
        axes[0].plot(steps, runs[name]["losses"], style, label=name)
    axes[0].set(xlabel="step", ylabel="loss", title="training loss (the curves overlap)")
    axes[0].legend()
    a, b = (runs[n]["losses"] for n in ("unfused", "torch_fce"))
    # Equal losses (a difference of 0) are drawn at the floor of the axis.
    axes[1].plot(steps, [max(abs(y - x) / abs(x), 1e-9) for x, y in zip(a, b)], "o-",
                 color="C2")
    axes[1].axhline(2.0 ** -22, color="gray", linestyle=":",
                    label="float32 rounding (2 ulps, as two float32 sums differ)")
    axes[1].set(xlabel="step", ylabel="|torch_fce - unfused| / unfused", yscale="log",
                ylim=(1e-9, 1e-2), title="per-step loss difference (0 at the floor)")
    axes[1].legend()
    for ax, key, unit, title in ((axes[2], "peak", "MiB", "peak memory of a step"),
                                 (axes[3], "time", "ms", "median step time")):
        vals = [runs[n]["peak_mib" if key == "peak" else "step_ms"] for n in names]
        ratio = record["ratios"][key]
        if ratio is None:  # a peak below the measurement's resolution
            ax.text(0.5, 0.5, "too small to measure", ha="center", transform=ax.transAxes)
            ax.set(title=title)
            continue
        bars = ax.bar(names, vals, color=["C0", "C1", "C2"][:len(names)])
        ax.bar_label(bars, [f"{v:.1f} {unit}" for v in vals])
        ax.set(ylabel=unit, title=f"{title}: torch_fce {ratio:.2f}x unfused")
        ax.set_ylim(0, max(vals) * 1.2)
    fig.suptitle(f"TinyLM vocab {args['vocab']}, dim {args['dim']}, {args['layers']} layers, "
                 f"batch {args['batch']}x{args['seq']}, {args['steps']} steps, accumulator "
                 f"{args['accumulator']} | {describe(env)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_fce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--steps", type=int, default=30,
                   help="training steps per run, at least 3: the first two compile "
                        "(default: 30)")
    p.add_argument("--tiny", action="store_true", help="a small model, for a quick check")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: 32000; --tiny 8192)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 128; --tiny 32)")
    p.add_argument("--layers", type=int, default=None, help="layers (default: 2; --tiny 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 256)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    p.add_argument("--accumulator", default="fp32", choices=("fp32", "kahan", "input"),
                   help="torch_fce's weight-gradient sums (default: fp32, exact)")
    p.add_argument("--out", default="torch_fce_main", help="folder for main.json and main.png (default: torch_fce_main)")
    args = p.parse_args(argv)
    check_device(p, args.device)
    size = dict(vocab=8192, dim=32, layers=1, seq=256, batch=8) if args.tiny else \
        dict(vocab=32000, dim=128, layers=2, seq=256, batch=8)
    for k, v in size.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    _check_sizes(p, args)
    prepare(args.device)  # before the first run, so neither hides memory from the other
    ids = corpus_ids(args.vocab)
    if args.seq + 1 >= len(ids):
        p.error(f"--seq must be below the corpus's {len(ids) - 1} tokens, got {args.seq}")
    env = environment()
    N = args.batch * args.seq
    print(f"# {describe(env)}")
    print(f"TinyLM vocab={args.vocab} dim={args.dim} layers={args.layers}, batch "
          f"{args.batch}x{args.seq} (fp32 logits {N * args.vocab * 4 / 2**20:.0f} MiB), "
          f"{len(ids)} corpus tokens, {args.steps} steps on {args.device}")
    names = [n for n in RUNS if n != "auto_chunker" or has_auto_chunker()]
    if "auto_chunker" not in names:
        print(f"no auto_chunker run: torch {torch.__version__}'s Inductor has no "
              "auto_chunker (torch >= 2.10)")
    runs = {name: train(args, ids, name, _bar(name)) for name in names}
    for name in names:  # after every memory figure (time_steps)
        print(f"{name:9} timing {TIMED_STEPS} steps of a fresh run", file=sys.stderr,
              flush=True)
        runs[name].update(time_steps(args, ids, name))
    a, b = runs["unfused"]["losses"], runs["torch_fce"]["losses"]
    for i in range(0, len(a), max(1, len(a) // 10)):
        print(f"step {i + 1:3d}  " + "  ".join(f"{n} {runs[n]['losses'][i]:.6f}"
                                             for n in names)
              + f"  torch_fce rel diff {abs(a[i] - b[i]) / abs(a[i]):.1e}")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    for name, run in runs.items():
        peak = "too small to measure" if run["peak_mib"] is None \
            else f"{run['peak_mib']:.1f} MiB"
        q1, q3 = run["step_ms_quartiles"]
        print(f"{name:12} peak {peak:>20}  step {run['step_ms']:8.1f} ms (quartiles "
              f"{q1:.1f}-{q3:.1f})  final loss {run['losses'][-1]:.6f}")
    cpu = torch.device(args.device).type == "cpu"
    print("peak memory: what one training step allocates beyond what is live before it ("
          + ("the process's resident-set high-water mark, VmHWM, on the CPU; not resolved "
             "below 1 MiB" if cpu else "torch.cuda.max_memory_allocated") + "); step time: "
          f"the median of {TIMED_STEPS} steps of a fresh run, timed after every memory "
          "figure" + (" with malloc as a user's process has it" if cpu else ""))
    ratios = _ratios(runs)
    print(f"largest per-step loss difference {worst:.1e}; torch_fce fused "
          f"{runs['torch_fce']['fused']} cross entropy; peak memory "
          + ("too small to measure at this size" if ratios["peak"] is None
             else f"{ratios['peak']:.2f} x unfused")
          + f"; step time {ratios['time']:.2f} x unfused")
    print(_verdict(runs, ratios["time"], cpu))
    record = dict(environment=env, args=vars(args), runs=runs, max_rel_loss_diff=worst,
                  ratios=ratios)
    if "auto_chunker" in runs:
        chunked = _ratios(runs, "auto_chunker")
        print("against Inductor's auto_chunker: torch_fce's peak memory "
              + ("too small to measure at this size" if chunked["peak"] is None
                 else f"{chunked['peak']:.2f} x") + f"; step time {chunked['time']:.2f} x")
        print(_verdict(runs, chunked["time"], cpu, "auto_chunker"))
        record["ratios_vs_auto_chunker"] = chunked
    with open(os.path.join(args.out, "main.json"), "w") as f:
        json.dump(record, f, indent=1)
    png = os.path.join(args.out, "main.png")
    try:
        plot(record, png)
        print(f"wrote {args.out}/main.json and main.png")
    except ImportError:
        stale = os.path.exists(png)
        if stale:  # an earlier run's figure would now describe other numbers
            os.remove(png)
        print(f"wrote {args.out}/main.json; no main.png: matplotlib is not installed "
              f"(pip install 'torch-fce[plot]')" + ("; removed an earlier run's main.png"
                                                    if stale else ""))


if __name__ == "__main__":
    main()

"""python -m torch_fce: the main job — train a small causal LM twice, unfused and fused.

A TinyLM (torch_fce/bench/tiny_lm.py, loss written the unfused way transformers writes it) is
trained with AdamW on text shipped in the package (its own docstrings, as word tokens
hashed into a large vocabulary), compiled with torch.compile, once as is and once with
torch_fce.lowering, which rewrites its loss into fce::linear_ce. Prints the loss of both
per step, their agreement, peak memory and step time; writes a JSON record and, with
matplotlib installed (the "plot" extra), a PNG.
"""

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import re
import sys
import time
import zlib

import torch
from torch._dynamo.utils import counters

import torch_fce
import torch_fce.lowering as lowering
from torch_fce.bench.env import describe, environment
from torch_fce.bench.measure import check_device, peak_extra_bytes
from torch_fce.bench.tiny_lm import TinyLM


def corpus_ids(vocab):
    """The package's docstrings as word tokens, hashed (crc32) into [0, vocab)."""
    text = []
    for info in pkgutil.walk_packages(torch_fce.__path__, "torch_fce."):
        module = importlib.import_module(info.name)
        text.append(module.__doc__ or "")
        text += [obj.__doc__ or "" for obj in vars(module).values()
                 if getattr(obj, "__module__", None) == info.name]
    words = re.findall(r"\w+|[^\w\s]", " ".join(text).lower())
    return torch.tensor([zlib.crc32(w.encode()) % vocab for w in words])


def batches(ids, batch, seq, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


def train(args, ids, fused, progress):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(args.vocab, dim=args.dim, layers=args.layers, heads=4,
                   max_len=args.seq).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_fn = torch.compile(model)
    fused_before = counters["inductor"][lowering.FUSED]
    losses, times = [], []

    def step(x):
        loss = step_fn(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    with lowering.fresh_compiles(), \
            lowering.auto_fuse(args.accumulator) if fused else contextlib.nullcontext():
        for i, x in enumerate(batches(ids, args.batch, args.seq, args.steps)):
            x = x.to(args.device)
            t0 = time.perf_counter()
            losses.append(step(x).item())
            times.append(time.perf_counter() - t0)
            progress(i + 1, args.steps, losses[-1])
        probe = next(batches(ids, args.batch, args.seq, 1, seed=1)).to(args.device)
        peak = peak_extra_bytes(lambda: step(probe), args.device)
    # The first steps compile; report the median of the rest.
    steady = sorted(times[2:])
    return dict(losses=losses, peak_mib=peak / 2**20, step_ms=steady[len(steady) // 2] * 1e3,
                fused=counters["inductor"][lowering.FUSED] - fused_before)


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


def plot(record, path):
    """Loss curves, their relative difference, peak memory and step time, with the
    machine and configuration in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, args, env = record["runs"], record["args"], record["environment"]
    names = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    steps = range(1, len(runs[names[0]]["losses"]) + 1)  # as the printed table: 1..N
    for name, style in zip(names, ("-", "--")):
        axes[0].plot(steps, runs[name]["losses"], style, label=name)
    axes[0].set(xlabel="step", ylabel="loss", title="training loss (the curves overlap)")
    axes[0].legend()
    a, b = (runs[n]["losses"] for n in names)
    # Equal losses (a difference of 0) are drawn at the floor of the axis.
    axes[1].plot(steps, [max(abs(y - x) / abs(x), 1e-9) for x, y in zip(a, b)], "o-",
                 color="C2")
    axes[1].axhline(2.0 ** -22, color="gray", linestyle=":",
                    label="float32 rounding (2 ulps, as two float32 sums differ)")
    axes[1].set(xlabel="step", ylabel="|torch_fce - unfused| / unfused", yscale="log",
                ylim=(1e-9, 1e-2), title="per-step loss difference (0 at the floor)")
    axes[1].legend()
    for ax, key, unit, title in ((axes[2], "peak_mib", "MiB", "peak memory of a step"),
                                 (axes[3], "step_ms", "ms", "median step time")):
        vals = [runs[n][key] for n in names]
        bars = ax.bar(names, vals, color=["C0", "C1"])
        ax.bar_label(bars, [f"{v:.1f} {unit}" for v in vals])
        ax.set(ylabel=unit, title=f"{title}: torch_fce {vals[1] / vals[0]:.2f}x")
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
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default: 30)")
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
    ids = corpus_ids(args.vocab)
    if args.seq + 1 >= len(ids):
        p.error(f"--seq must be below the corpus's {len(ids) - 1} tokens, got {args.seq}")
    env = environment()
    N = args.batch * args.seq
    print(f"# {describe(env)}")
    print(f"TinyLM vocab={args.vocab} dim={args.dim} layers={args.layers}, batch "
          f"{args.batch}x{args.seq} (fp32 logits {N * args.vocab * 4 / 2**20:.0f} MiB), "
          f"{len(ids)} corpus tokens, {args.steps} steps on {args.device}")
    runs = {name: train(args, ids, name == "torch_fce", _bar(name))
            for name in ("unfused", "torch_fce")}
    a, b = runs["unfused"]["losses"], runs["torch_fce"]["losses"]
    for i in range(0, len(a), max(1, len(a) // 10)):
        print(f"step {i + 1:3d}  unfused {a[i]:.6f}  torch_fce {b[i]:.6f}  "
              f"rel diff {abs(a[i] - b[i]) / abs(a[i]):.1e}")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    for name, run in runs.items():
        print(f"{name:10} peak {run['peak_mib']:8.1f} MiB  step {run['step_ms']:8.1f} ms  "
              f"final loss {run['losses'][-1]:.6f}")
    print("peak memory: what one training step allocates beyond what is live before it ("
          + ("torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else
             "the process's resident-set high-water mark, VmHWM, on the CPU") + ")")
    print(f"largest per-step loss difference {worst:.1e}; torch_fce fused "
          f"{runs['torch_fce']['fused']} cross entropy; peak memory "
          f"{runs['torch_fce']['peak_mib'] / runs['unfused']['peak_mib']:.2f} x unfused")
    slower = runs["torch_fce"]["step_ms"] / runs["unfused"]["step_ms"]
    if slower > 1.0:
        print(f"torch_fce's step took {slower:.2f}x the unfused one here. "
              + ("On a CPU its row math runs as plain PyTorch passes over each logits "
                 "chunk, which Inductor cannot fuse into the softmax as it does for the "
                 "unfused step, and this small model's matmuls are too cheap to hide them "
                 "(docs/benchmarks.md, lowering)." if args.device == "cpu" else
                 "This small model is launch-bound: the fused op runs each chunk's GEMMs "
                 "and row kernel as separate launches; at real sizes see "
                 "docs/benchmarks.md."))
    record = dict(environment=env, args=vars(args), runs=runs, max_rel_loss_diff=worst)
    os.makedirs(args.out, exist_ok=True)
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

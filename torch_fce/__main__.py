"""python -m torch_fce: the main job — fused vs unfused loss on a realistic problem.

Builds hidden (N, D), weight (V, D) and targets on the default device, runs
torch_fce.linear_cross_entropy and the unfused F.linear + F.cross_entropy, and prints
how closely loss and gradients agree and the peak memory and time of each.
"""

import argparse

import torch

from torch_fce.bench import Shape, _run, _torch_unfused, _fce, environment
from torch_fce.measure import median_time, peak_extra_bytes
from torch_fce.testing import make_inputs, rel_err


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_fce", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--N", type=int, default=8192)
    p.add_argument("--D", type=int, default=512)
    p.add_argument("--V", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--accumulator", default="fp32", choices=("fp32", "kahan", "input"))
    args = p.parse_args(argv)
    shape = Shape("main", args.N, args.D, args.V)
    x = make_inputs(shape.N, shape.D, shape.V, getattr(torch, args.dtype), device=args.device)
    print(f"# {environment()}")
    print(f"N={shape.N} D={shape.D} V={shape.V} dtype={args.dtype} device={args.device}")
    runs = {"unfused": _torch_unfused, "torch_fce": _fce(args.accumulator)}
    out, stats = {}, {}
    for name, fn in runs.items():
        out[name] = _run(fn, x)
        mem = peak_extra_bytes(lambda: _run(fn, x), args.device)
        stats[name] = (mem / 2**20, median_time(lambda: _run(fn, x), args.device, reps=3))
    for name, (mib, sec) in stats.items():
        print(f"{name:10} loss {out[name][0].item():.6f}  peak {mib:8.1f} MiB  "
              f"fwd+bwd {sec * 1e3:8.1f} ms")
    errs = [rel_err(a, b) for a, b in zip(out["torch_fce"], out["unfused"])]
    print("agreement (relative L2 vs unfused): loss {:.2e}  dE {:.2e}  dW {:.2e}".format(*errs))
    ratio = stats["torch_fce"][0] / max(stats["unfused"][0], 1e-9)
    print(f"torch_fce peak memory = {ratio:.3f} x unfused; time = "
          f"{stats['torch_fce'][1] / stats['unfused'][1]:.2f} x unfused")


if __name__ == "__main__":
    main()

"""The policy loss on the exp-GEMM pipeline (TORCH_FCE_BACKEND=exp): its step against
torch.compile and the chunk loop's rows, and the share of its row glue.

Per shape (bench/shapes.py, bf16; the RL bench's DAPO clip with a k3 KL at T 0.7):
 1. time: forward + backward, median of 10, the methods alternating in one process,
    the middle of three medians: torch.compile, fce-fp32 (the rows), fce-exp (the
    pipeline, its row glue the Triton kernels of linear_policy_loss/exp_kernels.py) and
    fce-exp-torch-rows (the same pipeline, its row glue the PyTorch twin), with peaks;
 2. --profile: per-kernel CUDA time of three steps of fce-exp and fce-fp32.

    source .peers/setup.sh && python -m torch_fce.bench.probes.policy_exp [E A] [--profile]
"""

import sys

import torch

from torch_fce.bench import rl
from torch_fce.bench.measure import median_time
from torch_fce.bench.peers import run_step
from torch_fce.bench.shapes import SHAPES, shape_inputs

from torch_fce.bench.probes._common import profile_steps


def with_torch_rows(fn):
    """fn with the pipeline's policy rows in PyTorch (exp_rows.policy_exp_rows)."""
    from torch_fce.ops.linear_policy_loss import exp_kernels, exp_rows

    def run(*args):
        kernel = exp_kernels.triton_policy_exp_rows
        exp_kernels.triton_policy_exp_rows = exp_rows.policy_exp_rows
        try:
            return fn(*args)
        finally:
            exp_kernels.triton_policy_exp_rows = kernel
    run.context = fn.context
    return run


def steps(x):
    fns = rl.methods("policy", "cuda", True)
    out = {k: fns[k] for k in ("torch.compile", "fce-fp32", "fce-exp")}
    out["fce-exp-torch-rows"] = with_torch_rows(fns["fce-exp"])
    return {k: (lambda f=f: run_step(f, x)) for k, f in out.items()}


def timing(x):
    fns = steps(x)
    for f in fns.values():  # warm up: compile, JIT, autotune
        f(), f()
    res, peaks = {k: [] for k in fns}, {}
    for _ in range(3):
        for k, f in fns.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            res[k].append(median_time(f, "cuda", reps=10, warmup=1) * 1e3)
            peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
    mm = median_time(lambda: x["hidden"] @ x["weight"].T, "cuda", reps=10, warmup=2) * 1e3
    ref = sorted(res["torch.compile"])[1]
    for k, v in res.items():
        t = sorted(v)[1]
        print(f"  {k:20s} {t:8.2f} ms  {t / mm:5.2f}x mm  {t / ref:.3f}x torch.compile  "
              f"extra peak {peaks[k]:8.0f} MiB  runs {['%.2f' % a for a in v]}", flush=True)
    print(f"  fce-exp / fce-exp-torch-rows: "
          f"{sorted(res['fce-exp'])[1] / sorted(res['fce-exp-torch-rows'])[1]:.3f}")


def profile(x):
    fns = steps(x)
    profile_steps({k: fns[k] for k in ("fce-exp", "fce-fp32")})


def main(argv):
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name in [a for a in argv if not a.startswith("-")] or ["E", "A"]:
        s = SHAPES[name]
        print(f"{name}: N {s.N} D {s.D} V {s.V}", flush=True)
        x = shape_inputs(s)
        x["data"] = rl.policy_data(x["hidden"], x["weight"], x["target"])
        timing(x)
        if "--profile" in argv:
            profile(x)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where linear_distillation_loss's step time goes, and what the workspace and the row
kernel's launch buy.

Per (student D, beta) of bench distill's pairs (N 16384, V 151936, teacher D 4096, bf16,
float32 logits): the GPU time of each kernel kind in one step (profiler), the step's
time and peak at several workspaces, and the row kernel alone on one chunk's float32
logits at several (BLOCK_V, warps), with the bandwidth it reaches (bytes read and
written / time).

    python torch_fce/bench/probes/distill_profile.py    # needs one CUDA GPU
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import torch_fce
from torch_fce.bench import distill
from torch_fce.bench.measure import median_time, peak_extra_bytes
from torch_fce.ops.linear_distillation import DistillOptions
from torch_fce.ops.linear_distillation import kernels as distill_rows

WORKSPACES_MIB = (None, 1536, 2048, 3072)
LAUNCHES = ((4096, 8), (4096, 16), (2048, 8), (2048, 4), (8192, 16))


def _kernels(step):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.lower()
            kind = "distill rows" if "distill" in name else \
                "gemm" if any(k in name for k in ("gemm", "sm90", "cutlass", "nvjet")) \
                else e.name[:50]
            kinds[kind] = kinds.get(kind, 0.0) + e.device_time / 1e3
    return kinds


def _rows_alone(n, V, beta):
    z_s = torch.randn(n, V, device="cuda") * 3
    z_t = torch.randn(n, V, device="cuda") * 3
    t = torch.randint(0, V, (n,), device="cuda")
    ones = torch.ones(n, device="cuda")
    opts = DistillOptions(beta=beta)
    sweeps = 2 if beta == 0.0 else 3
    nbytes = n * V * (8 * sweeps + 2)
    block_v, warps = distill_rows._block_v, distill_rows._WARPS
    for bv, w in LAUNCHES:
        distill_rows._block_v, distill_rows._WARPS = (lambda V, bv=bv: bv), w
        try:
            sec = median_time(lambda: distill_rows.triton_divergence_rows(
                z_s, z_t, t, None, ones, ones, opts, torch.float32, torch.bfloat16, True),
                "cuda", reps=10)
        finally:
            distill_rows._block_v, distill_rows._WARPS = block_v, warps
        print(f"    rows alone n={n} BLOCK_V={bv} warps={w}: {sec * 1e3:.3f} ms, "
              f"{nbytes / sec / 1e12:.2f} TB/s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="1024,2048")
    parser.add_argument("--betas", default="0,0.5")
    a = parser.parse_args()
    args = argparse.Namespace(N=16384, V=151936, Dt=4096)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for D in map(int, a.dims.split(",")):
        h, w, ht, wt, t = distill._inputs(args, D, "cuda")
        mm = median_time(lambda: h @ w.T, "cuda", reps=10)
        for beta in map(float, a.betas.split(",")):
            fn = distill._fce(beta)
            leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

            def step():
                return torch.autograd.grad(fn(*leaves, ht, wt, t), leaves)
            step()
            print(f"D={D} beta={beta} (one mm {mm * 1e3:.2f} ms)")
            for mib in WORKSPACES_MIB:
                with torch_fce.workspace(None if mib is None else mib << 20):
                    sec = median_time(step, "cuda", reps=10)
                    peak = peak_extra_bytes(step, "cuda") / 2**20
                    print(f"  workspace {mib or 'default'} MiB: {sec * 1e3:.2f} ms, "
                          f"peak {peak:.0f} MiB")
            for kind, ms_ in sorted(_kernels(step).items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {ms_:8.2f} ms  {kind}")
            _rows_alone(640, args.V, beta)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where the top-k row kernels' time goes (ops/linear_topk_logprobs/kernels.py), and what their
launch buys.

On one logits chunk (4096 x 151936 from a bf16 GEMM, D 1536, temperature 0.7), bf16
and float32 logits, k 8 / 50 / 128 / 256: each kernel's GPU time (profiler) at the
launch in use, against one read of the chunk (z.amax), then the whole call at other
sweep launches (classes a step, candidates kernel's warps, pipeline stages), its
classes checked bitwise against the launch in use's (the log-probs' largest difference
printed where not 0: a block's sums in another order).

    python -m torch_fce.bench.probes.topk_kernel    # needs one CUDA GPU
"""

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile

from torch_fce.bench.measure import median_time
from torch_fce.ops.linear_topk_logprobs import TopKOptions
from torch_fce.ops.linear_topk_logprobs import kernels as topk

N, D, V = 4096, 1536, 151936
KS = (8, 50, 128, 256)
# (block, candidates kernel's warps, stages); topk's _BLOCK, _WARPS[0], _STAGES in use
LAUNCHES = ((4096, 8, 1), (4096, 8, 3), (2048, 8, 3), (4096, 4, 3), (1024, 4, 3),
            (2048, 4, 1), (2048, 4, 4))


def _ms(fn):
    return median_time(fn, "cuda", reps=10, warmup=2) * 1e3


def _kernel_ms(call):
    """GPU ms of each kernel one call queues."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:30]] = times.get(e.name[:30], 0.0) + e.device_time / 1e3
    return times


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; chunk {N} x {V}, D {D}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, D, device="cuda", generator=gen) * (2 / D ** 0.5)).bfloat16()
    inv_t = torch.full((N,), 1 / 0.7, device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        z = F.linear(hidden, weight).to(dtype)
        read = _ms(lambda: z.amax(-1))
        print(f"{dtype} logits: one read {read:.3f} ms")
        for k in KS:
            opts = TopKOptions(k=k)

            def call(block=None, warps=topk._WARPS[0], stages=topk._STAGES):
                return topk.triton_topk_rows(z, None, inv_t, opts, torch.float32,
                                             warps=(warps, topk._WARPS[1]), block=block,
                                             stages=stages)

            kernels = " ".join(f"{name} {ms:.3f}" for name, ms in _kernel_ms(call).items())
            ref = call()
            line = [f"k {k}: {_ms(call):.3f} ms ({kernels})"]
            for launch in LAUNCHES:
                out = call(*launch)
                # the classes bit for bit; the log-probs within the sums' order
                lp = (out[1] - ref[1]).abs().max().item()
                line.append(f"{launch} {_ms(lambda: call(*launch)):.3f}"
                            + ("" if torch.equal(out[0], ref[0]) else " CLASSES DIFFER")
                            + (f" lp {lp:.1e}" if lp else ""))
            print("  " + " | ".join(line))


if __name__ == "__main__":
    main()

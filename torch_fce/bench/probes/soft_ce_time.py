"""What the sparse-target cross entropy costs against the plain cross entropy and an
unfused composition: forward + backward on one bf16 shape (N 16384, D 1536, V 151936,
a top-k of K classes per token), time (median of 10) and peak beyond the inputs.

    python torch_fce/bench/probes/soft_ce_time.py [K]    # needs one CUDA GPU
"""

import sys

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench.measure import median_time, peak_extra_bytes

N, D, V = 16384, 1536, 151936


def main():
    K = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).bfloat16().cuda()
    w = (torch.randn(V, D, generator=g) * 3 / D ** 0.5).bfloat16().cuda()
    t = torch.randint(0, V, (N,), generator=g).cuda()
    idx = torch.randint(0, V, (N, K), generator=g).cuda()
    probs = torch.softmax(torch.randn(N, K, generator=g), -1).cuda()

    def unfused(h, w):  # float32 log-softmax of bf16 logits
        lq = F.linear(h, w).float().log_softmax(-1)
        return -(probs * lq.gather(1, idx)).sum() / N

    methods = {
        "cross entropy (bf16 logits)": lambda h, w: torch_fce.linear_cross_entropy(h, w, t),
        "soft CE, float32 logits": lambda h, w: torch_fce.linear_soft_cross_entropy(
            h, w, idx, probs),
        "soft CE, bf16 logits": lambda h, w: torch_fce.linear_soft_cross_entropy(
            h, w, idx, probs, logits_dtype=None),
        "unfused (eager)": unfused,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N={N} D={D} V={V} "
          f"K={K}")
    mm = median_time(lambda: h @ w.T, "cuda", reps=10)
    for name, fn in methods.items():
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

        def step():
            return torch.autograd.grad(fn(*leaves), leaves)
        step()
        sec = median_time(step, "cuda", reps=10)
        peak = peak_extra_bytes(step, "cuda") / 2**20
        print(f"  {name}: {sec * 1e3:.2f} ms ({sec / mm:.2f}x mm), peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()

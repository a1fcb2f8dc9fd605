"""What do the loop's sparse-gradient products cost (ops/loop/sparse.py), and how does
the sparse divergence without the tail compare with the tail and the cross entropy?

At N x D x V (default 16384 x 1024 x 151936, bf16): the products of a K-entry gradient
(the hidden gradient's gather of K weight rows a token; the weight and bias gradients'
sort and per-class sums) for K = 8 and 64 on two supports, a teacher's top-K of random
heads (classes spread) and the worst case for the per-class sums, the same K classes in
every token (each class's row one program's loop over the batch); then one step
(forward + backward) of linear_sparse_divergence with and without the tail and of
linear_cross_entropy, each against one bf16 logits matmul; median of 5 after a warm-up.

    python -m torch_fce.bench.probes.sparse_grad [N:D:V] [--device cpu]
    (--device cpu: a smoke run at small sizes, the products' PyTorch path)
"""

import argparse

import torch

import torch_fce
from torch_fce.bench.measure import median_time
from torch_fce.ops.loop.sparse import SparseGrad, products


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", nargs="?")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dev = torch.device(args.device)
    shape = args.shape or ("256:64:4099" if dev.type == "cpu" else "16384:1024:151936")
    N, D, V = (int(x) for x in shape.split(":"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; N={N} D={D} V={V} {dtype}")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).to(dev, dtype)
    w = (torch.randn(V, D, generator=g) / D ** 0.5).to(dev, dtype)
    mm = median_time(lambda: h @ w.T, dev) * 1e3
    print(f"one logits matmul: {mm:.2f} ms")
    for K in (8, 64):
        top = torch_fce.linear_topk_logprobs(torch.randn_like(h), w, K)
        same = torch.arange(K, device=dev).expand(N, K).contiguous()
        for support, label in ((top.indices, "top-K of a random teacher"),
                               (same, "the same K classes in every token")):
            vals = torch.randn(N, K, generator=g).to(dev)
            grad = SparseGrad(support, vals)
            gh = torch.empty_like(h)

            def run():
                return products(grad, h, w, [True, True, True], gh, torch.float32)
            ms = median_time(run, dev) * 1e3
            print(f"K={K} {label}: products {ms:.2f} ms ({ms / mm:.3f}x mm)")
        lp = top.logprobs

        def step(fn):
            leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

            def go():
                out = fn(*leaves)
                (out[0] if isinstance(out, tuple) else out).backward()
            return go

        for label, fn in (
                ("sparse divergence, tail off", lambda a, b: torch_fce.linear_sparse_divergence(
                    a, b, top.indices, lp, tail=False)),
                ("sparse divergence, tail on", lambda a, b: torch_fce.linear_sparse_divergence(
                    a, b, top.indices, lp, tail=True)),
                ("linear_cross_entropy", lambda a, b: torch_fce.linear_cross_entropy(
                    a, b, top.indices[:, 0]))):
            ms = median_time(step(fn), dev) * 1e3
            print(f"K={K} {label}: {ms:.2f} ms a step ({ms / mm:.2f}x mm)")


if __name__ == "__main__":
    main()

"""Which cuBLAS library and dW layout, and is quack's cross-entropy row kernel faster?

Three levers of the chunk loop, at the chunk size the CUDA backend picks, on the
benchmark shapes A, B, C, each step over all N tokens in x mm (one (N, D) x (D, V)
bf16 matmul):
- cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library) for the logits,
  dE and float32-accumulating dW GEMMs, and for the whole op;
- dW accumulated as (V, D) += dz.T @ h (in use) against (D, V) += h.T @ dz;
- torch_fce's Triton row kernel (two reads and one write of each logit) against quack's
  CuTe cross-entropy kernel (`quack.cross_entropy.cross_entropy_fwd_out`, which keeps a
  row in a cluster's shared memory: one read, one write), when quack is installed.

    python torch_fce/bench/probes/gemm_and_row_choices.py     # needs one CUDA GPU
"""

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench.shapes import SHAPES, shape_inputs
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import ce_row_grad, ms, run_shapes

try:
    from quack.cross_entropy import cross_entropy_fwd_out
except Exception:  # not installed, or no CUDA 13 runtime
    cross_entropy_fwd_out = None


def _over_chunks(N, n, step):
    def run():
        for s in range(0, N, n):
            step(s, min(N, s + n))
    return run


def probe_shape(name):
    shape = SHAPES[name]
    x = shape_inputs(shape)
    h, w, t = x["hidden"], x["weight"], x["target"]
    N, V, D = shape.N, shape.V, shape.D
    n = chunk_rows(N, V, D, torch.bfloat16, "cuda")
    mm = ms(lambda: h @ w.T)
    z = F.linear(h[:n], w)
    dz = z.clone()
    gh = torch.empty_like(h)
    gw = torch.empty(V, D, device="cuda")
    gw_t = torch.empty(D, V, device="cuda")
    steps = {
        "logits": lambda s, e: torch.mm(h[s:e], w.t(), out=z[:e - s]),
        "dE": lambda s, e: torch.mm(dz[:e - s], w, out=gh[s:e]),
        "dW (V,D)": lambda s, e: torch.addmm(gw, dz[:e - s].t(), h[s:e],
                                             out_dtype=torch.float32, out=gw),
        "dW (D,V)": lambda s, e: torch.addmm(gw_t, h[s:e].t(), dz[:e - s],
                                             out_dtype=torch.float32, out=gw_t),
    }
    loss = lambda: torch_fce.linear_cross_entropy(  # noqa: E731
        h.detach().requires_grad_(), w.detach().requires_grad_(), t).backward()
    print(f"{name} ({N}x{D}x{V}), chunk {n} rows, mm {mm:.2f} ms", flush=True)
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        times = {k: ms(_over_chunks(N, n, f)) / mm for k, f in steps.items()}
        print(f"  {lib:8}: " + " ".join(f"{k} {v:.3f}" for k, v in times.items())
              + f" | whole op {ms(loss) / mm:.3f} x mm", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")

    ce, zs = torch.full((n,), 1.0 / N, device="cuda"), torch.zeros(n, device="cuda")
    ours = ms(_over_chunks(N, n, lambda s, e: ce_row_grad(z[:e - s], t[s:e], ce[:e - s],
                                                          zs[:e - s])))
    line = f"  row kernel: Triton {ours / mm:.3f} x mm ({3 * N * V * 2 / ours / 1e9:.2f} TB/s)"
    if cross_entropy_fwd_out is not None:
        loss_buf, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")

        def quack_rows(s, e):
            cross_entropy_fwd_out(z[:e - s], t[s:e], None, loss=loss_buf[:e - s],
                                  lse=lse[:e - s], dx=z[:e - s], weight=None)

        quack_rows(0, n)  # JIT compile
        theirs = ms(_over_chunks(N, n, quack_rows))
        line += (f", quack {theirs / mm:.3f} x mm ({2 * N * V * 2 / theirs / 1e9:.2f} TB/s "
                 f"for one read + one write)")
    print(line, flush=True)


if __name__ == "__main__":
    run_shapes(probe_shape)

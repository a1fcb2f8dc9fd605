"""Where the CUDA chunk loop's time goes, in units of one (N, D) x (D, V) bf16 matmul.

Times each step of torch_fce's chunk loop (logits GEMM, Triton row kernel, dE GEMM, dW
GEMM with float32 accumulation) with CUDA events over the whole token range, at the
chunk size the CUDA backend picks (and at 4096 and 8192 rows where those are larger),
on the shapes named on the command line (default A, B, C). "GEMMs" is the sum of the
three matmuls: the floor of any design that runs them through cuBLAS at this chunking.

    python torch_fce/bench/probes/chunk_breakdown.py      # needs one CUDA GPU
"""

import statistics

import torch
import torch.nn.functional as F

from torch_fce.bench.shapes import SHAPES, shape_inputs
from torch_fce.bench.measure import median_time
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import ce_row_grad, run_shapes

STEPS = ("logits", "rows", "dE", "dW")

def _event():
    return torch.cuda.Event(enable_timing=True)


def loop_ms(h, w, t, rows):
    """Per-step milliseconds of one pass of the chunk loop over all N tokens."""
    N = h.shape[0]
    ce, zs = torch.full((N,), 1.0 / N, device="cuda"), torch.zeros(N, device="cuda")
    gh = torch.empty_like(h)
    gw = torch.empty(w.shape, device="cuda")
    spent = dict.fromkeys(STEPS, 0.0)
    for s in range(0, N, rows):
        e = min(N, s + rows)
        ev = [_event() for _ in range(5)]
        ev[0].record()
        z = F.linear(h[s:e], w)
        ev[1].record()
        dz = ce_row_grad(z, t[s:e], ce[s:e], zs[s:e])
        ev[2].record()
        torch.mm(dz, w, out=gh[s:e])
        ev[3].record()
        if s == 0:  # as GradAccumulator: the first chunk writes, the others add
            torch.mm(dz.t(), h[s:e], out_dtype=torch.float32, out=gw)
        else:
            torch.addmm(gw, dz.t(), h[s:e], out_dtype=torch.float32, out=gw)
        ev[4].record()
        torch.cuda.synchronize()
        for k, a, b in zip(STEPS, ev, ev[1:]):
            spent[k] += a.elapsed_time(b)
    return spent


def probe_shape(name):
    """Probes one issue-3 shape; its tensors are freed on return."""
    shape = SHAPES[name]
    x = shape_inputs(shape)
    h, w, t = x["hidden"], x["weight"], x["target"]
    default = chunk_rows(shape.N, shape.V, shape.D, torch.bfloat16, "cuda")
    mm = median_time(lambda: h @ w.T, "cuda", reps=10, warmup=2) * 1e3
    # The default chunk, and the larger ones a bigger workspace would give.
    for rows in sorted({default, *(r for r in (4096, 8192) if default < r < shape.N)}):
        runs = [loop_ms(h, w, t, rows) for _ in range(5)]
        med = {k: statistics.median(r[k] for r in runs) / mm for k in STEPS}
        gemms = med["logits"] + med["dE"] + med["dW"]
        print(f"{name}: chunk {rows} rows, mm {mm:.2f} ms | "
              + " ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f" | GEMMs {gemms:.2f} + rows {med['rows']:.2f} = "
              f"{gemms + med['rows']:.2f} x mm", flush=True)


if __name__ == "__main__":
    run_shapes(probe_shape)

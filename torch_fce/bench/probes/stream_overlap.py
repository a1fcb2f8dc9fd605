"""Does a second stream hide the row kernel? The chunk loop three ways, whole-loop time.

  serial n      the loop as the CUDA backend runs it, chunks of n rows
  overlap n     the row kernel of chunk i on a second stream while the dE and dW GEMMs
                of chunk i-1 run (two n-row buffers alive: the memory of serial 2n)
  serial 2n     the same memory spent on one larger chunk instead

Prediction (written before the first run): cuBLAS's Hopper GEMMs occupy every SM, so the
row kernel only fills the GEMMs' tails; overlap gains at most 1-2% over serial n and
loses to serial 2n, which saves a float32 weight-gradient read-modify-write per chunk.

    python torch_fce/bench/probes/stream_overlap.py      # needs one CUDA GPU
"""

import torch
import torch.nn.functional as F

from torch_fce.bench.shapes import SHAPES, shape_inputs

from torch_fce.bench.probes._common import ce_row_grad, ms, run_shapes


def _grads(dz, h, w, gh, gw, s, e, first):
    torch.mm(dz, w, out=gh[s:e])
    if first:
        torch.mm(dz.t(), h, out_dtype=torch.float32, out=gw)
    else:
        torch.addmm(gw, dz.t(), h, out_dtype=torch.float32, out=gw)


def serial(h, w, t, ce, zs, gh, gw, n):
    for s in range(0, h.shape[0], n):
        e = min(h.shape[0], s + n)
        dz = ce_row_grad(F.linear(h[s:e], w), t[s:e], ce[s:e], zs[s:e])
        _grads(dz, h[s:e], w, gh, gw, s, e, s == 0)


def overlap(h, w, t, ce, zs, gh, gw, n, side):
    main = torch.cuda.current_stream()
    pending = None  # (dz, s, e) of the previous chunk, its row kernel queued on `side`
    for s in range(0, h.shape[0] + n, n):
        e = min(h.shape[0], s + n)
        nxt = None
        if s < h.shape[0]:
            z = F.linear(h[s:e], w)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dz = ce_row_grad(z, t[s:e], ce[s:e], zs[s:e])
            z.record_stream(side)
            nxt = (dz, s, e)
        if pending is not None:
            dz, ps, pe = pending
            _grads(dz, h[ps:pe], w, gh, gw, ps, pe, ps == 0)
        main.wait_stream(side)  # the next iteration's GEMMs read this chunk's dz
        pending = nxt


def probe_shape(name):
    shape = SHAPES[name]
    x = shape_inputs(shape)
    h, w, t = x["hidden"], x["weight"], x["target"]
    N = shape.N
    ce, zs = torch.full((N,), 1.0 / N, device="cuda"), torch.zeros(N, device="cuda")
    gh, gw = torch.empty_like(h), torch.empty(w.shape, device="cuda")
    side = torch.cuda.Stream()
    mm = ms(lambda: h @ w.T)
    out = []
    for n in (2048, 4096, 8192):
        if 2 * n > N:
            continue
        a = ms(lambda: serial(h, w, t, ce, zs, gh, gw, n))
        b = ms(lambda: overlap(h, w, t, ce, zs, gh, gw, n, side))
        c = ms(lambda: serial(h, w, t, ce, zs, gh, gw, 2 * n))
        out.append(f"n={n}: serial {a / mm:.3f} overlap {b / mm:.3f} serial-2n {c / mm:.3f}")
    print(f"{name} (mm {mm:.2f} ms, x mm): " + " | ".join(out), flush=True)


if __name__ == "__main__":
    run_shapes(probe_shape)

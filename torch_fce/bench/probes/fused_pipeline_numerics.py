"""Issue 56's numerics, without a GPU: which fused-GEMM pipeline is as exact as today's?

Emulates in PyTorch, rounding where each pipeline rounds (bf16 storage, bf16 operands of
the GEMMs, float32 sums elsewhere), one chunk of x (M, D) against the whole head W (V, D),
and prints the loss, dx and dW relative L2 errors against float64 (x @ W.T in float64).
The GEMMs' float32 sums are emulated as float64 products rounded to float32 (their own
accumulation error, ~sqrt(D) 2^-24, is far below every bf16 rounding here).

- today: torch_fce's Triton path (logits_dtype None): z rounded to bf16 as F.linear's,
  G = bf16(g (softmax(z) - onehot)) from float32 row math, dx = G W, dW = G^T x.
- today-f32: the same with logits_dtype=torch.float32 (z the GEMM's float32 sums).
- quack: quack 0.6.5's default pipeline (quack/linear_cross_entropy.py and
  quack/epilogue/scaled_exp.py): E = bf16(2^(z log2e - k)) from the float32 sums with k
  = rne(max z log2e) per (row, n-tile of tile_n1), sum_exp from E's float32 values, the
  target entry fixed in place to bf16((p_y - 1) e^(L - k ln2)), u = 2^(k - k_r) per (row,
  64 classes) (a power of two, exact), v = g 2^k_r e^-L per row; dx = v (E u) W (v in
  the epilogue, float32), dW = (E u)^T bf16(bf16(v) x) (x rounded a second time).
- quack-dW(a'): dW = (E bf16(u v))^T x: v folded into the strip, rounded per (row, 64
  classes), x unrounded.
- exp-f32v: dW's operand formed in the transform from E and float32 u v, rounded once
  more per element: bf16(E u v).
- split-*: as quack-dW(a') / exp-f32v, but E's target entry is left as p_y's and the
  one-hot term is added exactly, -g W[y_i] in dx's float32 epilogue and -g x_i into
  dW's row y_i (a float32 scatter of the chunk's rows). quack's fix rounds p_y - 1
  scaled by e^(L - k ln2), an arbitrary mantissa, where today's bf16(p_y - 1) of a
  spread row is nearly -1, a power of two: that one entry is most of quack's dx error.

    python -m torch_fce.bench.probes.fused_pipeline_numerics [D E A Q1024] [--rows M]
"""

import argparse
import math

import torch

from torch_fce.bench.shapes import SHAPES

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64


def rel(a, e):
    return ((a.double() - e).norm() / e.norm()).item()


def gemm32(a, b):
    """A GEMM of bf16 operands with float32 sums (emulated: float64, rounded once)."""
    return (a.double() @ b.double()).float()


def today(x, w, t, g, wide):
    z = gemm32(x, w.T)
    if not wide:
        z = z.bfloat16().float()
    lse = torch.logsumexp(z, 1)
    p = torch.exp(z - lse[:, None])
    p[torch.arange(len(t)), t] -= 1.0
    G = (g * p).bfloat16()
    loss = lse - z.gather(1, t[:, None])[:, 0]
    return loss, gemm32(G, w), gemm32(G.T, x)


def quack_parts(x, w, t, tile_n1, fix_target=True):
    """quack's logits GEMM epilogue and glue: (loss, E with the target fixed unless
    fix_target is False, u, k_r, L)."""
    M, V = x.shape[0], w.shape[0]
    z = gemm32(x, w.T)
    T = V // tile_n1
    zt = z.view(M, T, tile_n1)
    k = torch.round(zt.amax(2) * LOG2E)  # rne, per (row, n-tile)
    e32 = torch.exp2(zt * LOG2E - k[:, :, None])
    sum_exp = e32.sum(2)
    E = e32.bfloat16().view(M, V)
    k_r = k.amax(1)
    L = k_r * LN2 + torch.log((sum_exp * torch.exp2(k - k_r[:, None])).sum(1))
    zy = z.gather(1, t[:, None])[:, 0]
    loss = L - zy
    ky = k.gather(1, (t // tile_n1)[:, None])[:, 0]
    fix = (torch.exp(zy - L) - 1.0) * torch.exp(L - ky * LN2)
    if fix_target:
        E[torch.arange(M), t] = fix.bfloat16()
    u = torch.exp2(k - k_r[:, None]).repeat_interleave(tile_n1, 1)  # (M, V), pow2
    return loss, E, u, k_r, L


def quack(x, w, t, g, tile_n1, dw_mode, split_target=False):
    """split_target: E keeps p_y's entry unfixed and the one-hot term -g is added
    exactly: -g W[y] in dx's epilogue (float32), -g x_i into dW's row y_i (a float32
    scatter of the chunk's rows)."""
    loss, E, u, k_r, L = quack_parts(x, w, t, tile_n1, not split_target)
    v = g * torch.exp2(k_r) * torch.exp(-L)  # float32 per row
    Eu = (E.float() * u).bfloat16()  # a power of two: exact unless it underflows
    dx = gemm32(Eu, w) * v[:, None]
    if split_target:
        dx = dx - g * w[t].float()
    if dw_mode == "quack":
        xs = (v.bfloat16().float()[:, None] * x.float()).bfloat16()
        dW = gemm32(Eu.T, xs)
    elif dw_mode == "strip":
        uv = (u * v[:, None]).bfloat16()  # per (row, 64 classes): constant there
        dW = gemm32((E.float() * uv.float()).bfloat16().T, x)
    else:  # "f32v": the transform multiplies by float32 u v and rounds once
        dW = gemm32((E.float() * u * v[:, None]).bfloat16().T, x)
    if split_target:
        dW = dW.index_add(0, t, x.float(), alpha=-g)
    return loss, dx, dW


def inputs(shape, rows, scale, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    D, V = shape.D, shape.V
    x = torch.randn(rows, D, generator=g) / D ** 0.5
    w = torch.randn(V, D, generator=g) * scale
    if offset:  # a shared direction: every logit shifted by about `offset`
        x[:, 0] = offset / scale
        w[:, 0] = scale + 0.1 * scale * torch.randn(V, generator=g)
    t = torch.randint(0, V, (rows,), generator=g)
    if offset:  # confident rows: the target is the row's largest logit
        t = (x.bfloat16().double() @ w.bfloat16().double().T).argmax(1)
    return x.bfloat16(), w.bfloat16(), t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["D", "E", "A", "Q1024"])
    ap.add_argument("--rows", type=int, default=256)
    a = ap.parse_args()
    regimes = (("z std 2", 2.0, 0.0), ("z std 8", 8.0, 0.0), ("offset 20, confident", 2.0, 20.0))
    print(f"one chunk of {a.rows} rows, sum reduction (g = 1); relative L2 error against "
          "float64; torch " + torch.__version__)
    for name in a.shapes:
        s = SHAPES[name]
        tile_n1 = next(n for n in (192, 256, 128, 64) if s.V % n == 0)
        for label, scale, offset in regimes:
            x, w, t = inputs(s, a.rows, scale, offset)
            z64 = x.double() @ w.double().T
            lse = torch.logsumexp(z64, 1)
            loss64 = lse - z64.gather(1, t[:, None])[:, 0]
            G64 = torch.exp(z64 - lse[:, None])
            del z64
            G64[torch.arange(a.rows), t] -= 1.0
            dx64, dW64 = G64 @ w.double(), G64.T @ x.double()
            del G64
            print(f"{name} ({a.rows} x {s.D} x {s.V}, tile_N {tile_n1}), {label}:")
            runs = (("today", lambda: today(x, w, t, 1.0, False)),
                    ("today-f32", lambda: today(x, w, t, 1.0, True)),
                    ("quack", lambda: quack(x, w, t, 1.0, tile_n1, "quack")),
                    ("quack-dW(a')", lambda: quack(x, w, t, 1.0, tile_n1, "strip")),
                    ("exp-f32v", lambda: quack(x, w, t, 1.0, tile_n1, "f32v")),
                    ("split-strip", lambda: quack(x, w, t, 1.0, tile_n1, "strip", True)),
                    ("split-f32v", lambda: quack(x, w, t, 1.0, tile_n1, "f32v", True)))
            base = None
            for method, fn in runs:
                loss, dx, dW = fn()
                errs = (rel(loss, loss64), rel(dx, dx64), rel(dW, dW64))
                base = base or errs
                print(f"  {method:13s} loss {errs[0]:.2e}  dx {errs[1]:.2e} "
                      f"({errs[1] / base[1]:.2f}x today)  dW {errs[2]:.2e} "
                      f"({errs[2] / base[2]:.2f}x today)", flush=True)


if __name__ == "__main__":
    main()

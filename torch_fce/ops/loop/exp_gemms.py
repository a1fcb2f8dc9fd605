"""The exp-GEMM pipeline: a chunk's softmax carried by its GEMMs, no sweep of its logits.

Per chunk of M token rows x (M, D) against the head W (V, D), bf16 (docs/design.md):
- logits GEMM, whose epilogue stores, from the float32 sums z, E = bf16(2^(z log2e - k))
  with k = rne(max z log2e) per (row, n-tile of tile_n classes), and writes per (row,
  n-tile) sum_exp (the float32 e's sum) and k, and per row z at a selected column (the
  target's): an `ExpTile`. The logits themselves are never stored. With a per-row
  inverse temperature t it is z t in place of z, and the epilogue also writes per (row,
  n-tile) sum_ey = sum e (z t log2e - k), the entropy's partial.
- an op's row math (its glue, on (M, T) partials: ops/<op>/exp_rows.py) merges them into
  lse = k_r ln2 + log sum_t sum_exp 2^(k_t - k_r) (k_r = max_t k) and its per-token terms,
  and writes its logits gradient as an `ExpGrad`: dz[i, c] = v_i (E u)[i, c] - b_i [c ==
  col_i] - cs_i w_c, u = 2^(k_t - k_r) per (row, 64 classes) (an exact power of two).
- dx GEMM: dx = v (E u) W - b W[col] - cs r (r = sum_c w_c W_c), E read through an operand
  transform (times the u strip), v, b, cs and r in its float32 epilogue: rounded once.
- dW GEMM: dW += (E bf16(u v))^T x in float32 (v varies along this GEMM's K, the tokens,
  so it is folded into the strip: one bf16 rounding of the per-row factor, x unrounded);
  the one-hot and smoothing terms are added once at the end in float32 (exp_tail).
Against float64 this is more exact than the chunk loop's bf16 logits and their gradient
(bench/probes/fused_pipeline_numerics.py): E's target entry keeps p_y's form, and the
one-hot term is added exactly (quack-kernels' pipeline, whose pieces these are, rounds
(p_y - 1) e^(L - k ln2) into E instead, and rounds x times v again for dW).

Two twins of one signature: `cute` (quack-kernels' CuTe DSL GEMMs, sm_90, exp_gemms_cute)
and `torch` (this file: the same roundings in PyTorch, the reference the kernels are held
to and what CPU tests run). The op picks the pipeline (`served`), `run_exp_chunks` (the
pipeline's token-chunk loop, at the end) the twin.
"""

import math
from typing import NamedTuple, Optional

import torch

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
STRIP = 64  # classes per strip entry (the dW transform's m64 groups)
ROWS = 128  # chunks run in whole GEMM tiles of rows (the last zero-padded)
# A chunk's bytes per logit: E, the two strips, sum_exp and k at the smallest n-tile
BYTES_PER_LOGIT = 2 + 2 * 2 / STRIP + 8 / 64


class ExpTile(NamedTuple):
    """The logits GEMM's output for a chunk of M rows (M a multiple of ROWS): E (M, V)
    bf16, sum_exp and k (M, T) float32 (T = V / tile_n n-tiles), zy (M,) float32: z at
    each row's selected column (unwritten where it has none), raw (not times t); sum_ey
    (M, T) float32 where the GEMM ran at an inverse temperature, else None."""
    E: torch.Tensor
    sum_exp: torch.Tensor
    k: torch.Tensor
    zy: torch.Tensor
    sum_ey: Optional[torch.Tensor] = None


class ExpGrad(NamedTuple):
    """A chunk's logits gradient, dz = v (E u) - b onehot(col) - cs w (module doc): u and
    uv (V / STRIP, M) bf16 strips (u an exact power of two, uv = bf16(u v)); v, b, cs (M,)
    float32 (cs zeros without smoothing); col (M,) int64, -1 where b is 0."""
    E: torch.Tensor
    u: torch.Tensor
    uv: torch.Tensor
    v: torch.Tensor
    b: torch.Tensor
    col: torch.Tensor
    cs: torch.Tensor


def tile_n_for(V):
    """The logits GEMM's n-tile, k's granularity: a divisor of V and multiple of STRIP
    (quack's rule: 192 measured best at Llama's vocabulary), None if there is none."""
    return next((n for n in (192, 256, 128, 64) if V % n == 0), None)


def served(hidden, weight):
    """Whether the pipeline can run these operands: bf16 both, V a multiple of 128 (the
    dW GEMM's M tiles) with an n-tile, D a multiple of 8 (16-byte rows)."""
    V, D = weight.shape
    return (hidden.dtype == weight.dtype == torch.bfloat16 and V % 128 == 0
            and tile_n_for(V) is not None and D % 8 == 0)


def merged(tile):
    """(k_r, u, S) of an ExpTile's partials: k_r = max_t k (M,), u = 2^(k - k_r) (M, T),
    exact powers of two (the strips' entries), 0 below 2^-126 (no subnormals: an n-tile
    that small is below S's rounding, S >= 1/sqrt 2), and S = sum_t sum_exp u (M,), so
    that p = E u / S and lse = k_r ln2 + log S; all float32."""
    k_r = tile.k.amax(1)
    d = tile.k - k_r[:, None]
    u = torch.where(d >= -126.0, torch.exp2(d), torch.where(d.isnan(), d, 0.0))
    return k_r, u, (tile.sum_exp * u).sum(1)


def lse_of(tile):
    """(lse, k_r, u) of an ExpTile's partials (merged's k_r and u), each float32."""
    k_r, u, S = merged(tile)
    return k_r * LN2 + torch.log(S), k_r, u


def entropy_of(tile, k_r, u, S):
    """The entropy -sum_c p_c log p_c (M,) float32 of a tempered ExpTile (its sum_ey)
    from merged's k_r, u, S: ln2 (log2 S - sum_c p_c (y_c - k_r)), y = z t log2e, the
    mean from the n-tiles' sum_e (y - k_t) and (k_t - k_r) sum_e, all relative to k_r
    (no term of the logits' magnitude)."""
    mean = ((tile.sum_ey + (tile.k - k_r[:, None]) * tile.sum_exp) * u).sum(1) / S
    return LN2 * (torch.log2(S) - mean)


def strips(u, v, tile_n):
    """(u, uv) (V / STRIP, M) bf16 strips of lse_of's u (M, T) and v (M,): u itself
    (exact) and uv = bf16(u v), each entry repeated for the STRIP-class groups of its
    n-tile."""
    rep = tile_n // STRIP
    return tuple(a.t().bfloat16().repeat_interleave(rep, 0) for a in (u, u * v[:, None]))


# ---- the PyTorch twin -------------------------------------------------------------

def logits(x, w, col, tile_n, E, inv_t=None):
    """ExpTile of x (M, D) against w (V, D), bf16, its E written into E (M, V) bf16; col
    (M,) the selected columns; inv_t None or (M,) float32, the rows' 1 / T."""
    M, V = x.shape[0], w.shape[0]
    z = x.float() @ w.float().t()  # the float32 sums of bf16 products
    zt = z.view(M, V // tile_n, tile_n)
    if inv_t is not None:
        zt = zt * inv_t[:, None, None]
    k = torch.round(zt.amax(2) * LOG2E)  # = max_c of y = zt log2e (rounding is monotone)
    y = zt * LOG2E - k[:, :, None]
    e = torch.exp2(y)
    here = (col >= 0) & (col < V)
    zy = torch.where(here, z.gather(1, col.clamp(0, V - 1)[:, None])[:, 0], 0.0)
    E.copy_(e.view(M, V))
    return ExpTile(E, e.sum(2), k, zy, None if inv_t is None else (e * y).sum(2))


class DxTiles(NamedTuple):
    """The dx GEMM's plan: tile_n, its output tiles' width over D, and split, the serial
    splits of V (its K) each tile's float32 sums run in. A split makes more, shorter
    tiles to fill a wave; the splits commit in split order (quack's SplitKMode.SERIAL),
    so the sums are deterministic run to run and rounded once, in the epilogue."""
    tile_n: int
    split: int = 1


def plan(N, D, V, rows, device):
    """(rows, dx) of the chunk loop: rows whole tiles of ROWS within the workspace's
    (rows), one tile at the least; dx the dx GEMM's DxTiles (None: the twin has none)."""
    return max(ROWS, min(rows, N) // ROWS * ROWS), None


# wave_plan's cost model, in seconds: a dx tile's time (2 x 128 x tile_N x V / split
# FLOP at an SM's share of a Hopper GPU's bf16 rate) per wave, and a chunk's fixed cost
# (its dW GEMM's reduce-add reads and writes the float32 sum, 8 V D bytes, at about HBM
# speed).
_SM_FLOPS = 5.0e12
_HBM_BYTES = 3.5e12
# dx tile_N -> its time per FLOP against the widest (a narrower tile does fewer MMAs per
# byte loaded: on an H100 at the same chunk, tile_N 128 made E's and A's steps 8% and
# 10% slower than 256, its dx about 1.3x); ties go to the wider tile, then fewer splits
_DX_TILES_N = {256: 1.0, 192: 1.0, 128: 1.3}
_DX_SPLITS = (1, 2, 3, 4)
# a split tile's time per FLOP, more per extra split (fitted on an H100, 2026-12-07:
# three splits made E's step 1.3% slower at the same modelled waves and A's 1.6% at a
# tenth fewer; Q1024's 7% faster at a third fewer, docs/benchmarks.md)
_SPLIT_COST = 0.05


def _chunk_cost(m, N, D, V, dx, sms):
    """Modelled seconds of N rows in chunks of m (a multiple of ROWS) at DxTiles dx."""
    waves = 0
    for s in range(0, N, m):
        tiles_m = -(-min(m, N - s) // ROWS)
        clusters = -(-tiles_m // 2) * -(-D // dx.tile_n) * dx.split  # cluster_M 2
        waves += -(-clusters // (sms // 2))
    per_flop = _DX_TILES_N[dx.tile_n] * (1.0 + _SPLIT_COST * (dx.split - 1)) / _SM_FLOPS
    return (waves * 2 * ROWS * dx.tile_n * V / dx.split * per_flop
            + -(-N // m) * 8 * V * D / _HBM_BYTES)


def wave_plan(N, D, V, rows, sms):
    """The CUDA twin's plan on a GPU of sms SMs. The dx GEMM's output is only chunk x D,
    so its tiles are few and each runs the whole V: a chunk whose tiles spill a few past
    a wave of the SMs costs a second wave (measured on an H100 at D 896: a 2816-row
    chunk's dx 1.49x cuBLAS's E @ W, a 2048-row one's 1.07x), unless V is split. Of the
    balanced chunkings within the workspace (up to 8 more chunks than it needs), the dx
    tiles and splits, the one the cost model above finds fastest."""
    cap = max(ROWS, min(rows, N) // ROWS * ROWS)
    N, first = max(N, 1), -(-max(N, 1) // cap)
    sizes = {-(-(-(-N // n)) // ROWS) * ROWS for n in range(first, first + 9)}
    return min(((m, DxTiles(tn, k)) for m in sorted(sizes, reverse=True) if m <= cap
                for tn in _DX_TILES_N for k in _DX_SPLITS),
               key=lambda o: _chunk_cost(o[0], N, D, V, o[1], sms))


def dx(g, w, r, out, tiles=None):
    """out (M, D) = dx of ExpGrad g (module doc), rounded once into out's dtype; r (D,)
    float32 sum_c w_c W_c (zeros without smoothing); tiles: the CUDA twin's DxTiles."""
    M, V = g.E.shape
    u = g.u.t().repeat_interleave(STRIP, 1).float()  # (M, V)
    acc = (g.E.float() * u).bfloat16().float() @ w.float()  # the transform's bf16 operand
    wy = w[g.col.clamp_min(0)].float()
    out.copy_(acc * g.v[:, None] - g.b[:, None] * wy - g.cs[:, None] * r[None, :])


def dw_add(g, x, dw, first):
    """dw (V, D) float32 = (first: ) / += (E uv)^T x."""
    uv = g.uv.t().repeat_interleave(STRIP, 1).float()  # (M, V)
    a = (g.E.float() * uv).bfloat16().float()
    if first:
        torch.mm(a.t(), x.float(), out=dw)
    else:
        dw.addmm_(a.t(), x.float())


def exp_tail(dw, col, b, x, s=None, cw=None, triton=False):
    """The one-hot and smoothing terms of dW over all N tokens x (N, D), in place and in
    float32: dw[col_i] -= b_i x_i (each class's sum in token order, sparse.scatter_add;
    rows with col -1 add nothing) and, with smoothing, dw -= outer(w, s), s = sum_i cs_i
    x_i (D,) float32 and w the class weights or ones."""
    from .sparse import SparseGrad, scatter_add
    grad = SparseGrad(col.clamp_min(0)[:, None], torch.where(col >= 0, -b, 0.0)[:, None])
    scatter_add(grad, x, dw, triton)
    if s is not None:
        w = torch.ones(dw.shape[0], device=dw.device) if cw is None else cw.float()
        dw.addr_(w, s, alpha=-1.0)


def twin(device):
    """The pipeline's pieces for tensors on device: (plan, logits, dx, dw_add)."""
    if device.type == "cuda":
        from . import exp_gemms_cute as cute
        return cute.plan, cute.logits, cute.dx, cute.dw_add
    return plan, logits, dx, dw_add


def run_exp_chunks(hidden, weight, row_fn, outputs, needs_grad, chunk_rows, select, keep,
                   smoothing_w=None, triton=False, inv_t=None):
    """The token-chunk loop on the exp-GEMM pipeline (no logits, no dz), in chunks of at
    most about the workspace's chunk_rows (the twin's plan). Each chunk's rows are staged
    into whole GEMM tiles, those not `keep` (N,) bool (no loss term, no gradient: ignored
    tokens) and the padding zeroed, so what their hidden states hold reaches nothing; one
    E buffer serves every chunk. row_fn(tile, s, e, m, zsum) gets the chunk's ExpTile (m
    rows, the chunk's e - s first) and zsum, sum_c w_c z_c of each row with a smoothing
    term (else None), and returns (terms, ExpGrad or None), each term (m,).
    select (N,): the column of each row whose logit the GEMM gathers (-1: none).
    smoothing_w: None, or the (V,) class weights (ones) of a smoothing term in the
    gradient (its r = W^T w feeds dx, its rank-1 term dW). inv_t: None, or (N,) float32,
    each row's 1 / T for the logits GEMM (a tempered ExpTile). Returns (grad_hidden in
    hidden's dtype, grad_weight float32, None), each None unless flagged."""
    plan_of, logits_of, dx_of, dw_add_of = twin(hidden.device)
    N, D = hidden.shape
    V = weight.shape[0]
    rows, dx_tiles = plan_of(N, D, V, chunk_rows, hidden.device)
    tile_n = tile_n_for(V)
    w = weight.to(hidden.dtype)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    gh = hidden.new_empty(N, D) if needs_grad[0] else None
    gw = torch.empty(V, D, **f32) if needs_grad[1] else None
    smooth = smoothing_w is not None
    r = smoothing_w.float() @ w.float() if smooth else torch.zeros(D, **f32)
    s_vec = torch.zeros(D, **f32) if smooth else None  # sum_i cs_i x_i
    stage, zero = hidden.new_zeros(rows, D), hidden.new_zeros(())
    t_stage = None if inv_t is None else torch.empty(rows, **f32)
    one = torch.ones((), **f32)
    E = hidden.new_empty(rows, V)
    cols, bs = [], []
    for s in range(0, N, rows):
        e = min(N, s + rows)
        n, m = e - s, -(-(e - s) // ROWS) * ROWS
        x = stage[:m]
        torch.where(keep[s:e, None], hidden[s:e], zero, out=x[:n])
        x[n:] = 0
        col = select.new_full((m,), -1)
        col[:n] = select[s:e]
        zsum = x.float() @ r if smooth else None
        t = None
        if inv_t is not None:  # 1 on the rows not kept and the padding (their z is 0)
            t = t_stage[:m]
            torch.where(keep[s:e], inv_t[s:e], one, out=t[:n])
            t[n:] = 1.0
        terms, g = row_fn(logits_of(x, w, col, tile_n, E[:m], t), s, e, m, zsum)
        for out, term in zip(outputs, terms):
            out[s:e] = term[:n]
        if g is None:
            continue
        if gh is not None:
            if m == n:
                dx_of(g, w, r, gh[s:e], dx_tiles)
            else:  # the ragged last chunk's padding rows have nowhere to go in gh
                part = hidden.new_empty(m, D)
                dx_of(g, w, r, part, dx_tiles)
                gh[s:e] = part[:n]
        if gw is not None:
            dw_add_of(g, x, gw, first=s == 0)
            if smooth:
                s_vec += g.cs @ x.float()
        cols.append(g.col[:n])
        bs.append(g.b[:n])
    if gw is not None and cols:
        exp_tail(gw, torch.cat(cols), torch.cat(bs), hidden, s_vec, smoothing_w, triton)
    elif gw is not None:  # no tokens
        gw.zero_()
    return gh, gw, None



"""The cross entropy's row math on the exp-GEMM pipeline in one Triton kernel a chunk.

The twin of exp_rows.exp_rows (same signature, same roundings): from the chunk's
(row, n-tile) partials to the per-token terms, the per-row coefficients and both
strips, which the PyTorch twin forms in about 25 small operations a chunk (on the GPU
each a launch and a pass over (M, T) or (M,) values: a profile of an earlier state put
them at about 1.4 ms of a D step, docs/benchmarks.md).
One program per block of rows, two sweeps of its partials: the first merges them
online (k_r = max_t k, S = sum_t sum_exp 2^(k_t - k_r)), the second writes the strips
u = 2^(k_t - k_r) and bf16(u v) in their (V / STRIP, M) layout. Powers of two are built
from their bits, so the strips equal the twin's bit for bit.
"""

import torch
import triton
import triton.language as tl

from ..loop import exp_gemms
from ..rowmath.kernels import _pow2, _store_strips
from .rows import CETerms

BLOCK_M, BLOCK_T = 16, 128
_LN2 = tl.constexpr(exp_gemms.LN2)


@triton.jit
def _exp_ce_rows_kernel(
    sum_exp_ptr, k_ptr, zy_ptr, target_ptr, class_weight_ptr, weight_sum_ptr,
    ce_scale_ptr, z_scale_ptr, zsum_ptr,
    lse_ptr, nll_ptr, smooth_ptr, v_ptr, b_ptr, col_ptr, cs_ptr, u_ptr, uv_ptr,
    M, n, T, V, ignore_index, label_smoothing,
    REP: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, DFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rows [pid BLOCK_M, +BLOCK_M) of a chunk of M rows (n of them tokens, the rest
    padding: ignored): sum_exp, k (M, T) -> lse, nll, smooth (M,); with HAS_GRAD v, b,
    col, cs (M,) and the strips u, uv (T REP, M) bf16 (exp_rows' math)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    ts = tl.arange(0, BLOCK_T)
    base = rows.to(tl.int64)[:, None] * T
    # sweep 1: k_r and S online; rescaling by a power of two is exact, so S is the
    # twin's sum of the same exact terms
    k_r = tl.full([BLOCK_M], float("-inf"), tl.float32)
    S = tl.zeros([BLOCK_M], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        mask = live[:, None] & (t0 + ts < T)[None, :]
        k = tl.load(k_ptr + base + t0 + ts[None, :], mask=mask, other=float("-inf"))
        se = tl.load(sum_exp_ptr + base + t0 + ts[None, :], mask=mask, other=0.0)
        k_new = tl.maximum(k_r, tl.max(k, axis=1))
        S = S * _pow2(k_r - k_new) + tl.sum(se * _pow2(k - k_new[:, None]), axis=1)
        k_r = k_new
    lse = k_r * _LN2 + tl.log(S)

    # per-token terms (as exp_rows.exp_rows, rows.grad_coefficients)
    tok = live & (rows < n)
    t = tl.load(target_ptr + rows, mask=tok, other=ignore_index).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    t_safe = tl.where(valid & in_range, t, 0)
    w_y = tl.load(class_weight_ptr + t_safe, mask=live).to(tl.float32) \
        if HAS_CLASS_WEIGHT else 1.0
    w_y = tl.where(valid, tl.where(in_range, w_y, float("nan")), 0.0)
    W = tl.load(weight_sum_ptr).to(tl.float32) if HAS_CLASS_WEIGHT else V * 1.0
    z_y = tl.load(zy_ptr + rows, mask=live, other=0.0)
    nll = tl.where(valid, w_y * (lse - z_y), 0.0)
    p_y = tl.where(valid, tl.exp(z_y - lse), 0.0) if DFT else 1.0
    tl.store(lse_ptr + rows, lse, mask=live)
    tl.store(nll_ptr + rows, nll * p_y, mask=live)
    if HAS_SMOOTHING:
        zsum = tl.load(zsum_ptr + rows, mask=live, other=0.0)
        tl.store(smooth_ptr + rows, tl.where(valid, W * lse - zsum, 0.0), mask=live)
    else:
        tl.store(smooth_ptr + rows, tl.zeros([BLOCK_M], tl.float32), mask=live)
    if HAS_GRAD:
        s_ce = tl.load(ce_scale_ptr + rows, mask=tok, other=0.0) * p_y
        s_z = tl.load(z_scale_ptr + rows, mask=tok, other=0.0)
        a = s_ce * ((1.0 - label_smoothing) * w_y + (label_smoothing / V) * W) \
            + 2.0 * s_z * lse
        a = tl.where((s_ce == 0.0) & (s_z == 0.0), 0.0, a)
        b = s_ce * (1.0 - label_smoothing) * w_y
        # v = a / S = a e^(k_r ln2 - lse), without 2^k_r's overflow; 0 where a is
        v = tl.where(a == 0.0, 0.0, a * tl.exp(k_r * _LN2 - lse))
        here = valid & in_range & (b != 0.0)
        tl.store(v_ptr + rows, v, mask=live)
        tl.store(b_ptr + rows, tl.where(here, b, 0.0), mask=live)
        tl.store(col_ptr + rows, tl.where(here, t, -1), mask=live)
        cs = tl.where(valid, s_ce * (label_smoothing / V), 0.0) if HAS_SMOOTHING else 0.0
        tl.store(cs_ptr + rows, tl.zeros([BLOCK_M], tl.float32) + cs, mask=live)
        # sweep 2: the strips
        _store_strips(k_ptr, u_ptr, uv_ptr, rows, live, k_r, v, M, T, REP, BLOCK_T)


def triton_exp_rows(tile, target, class_weight, scales, opts, V, zsum):
    """exp_rows.exp_rows on the Triton kernel: target and scales' (n,) vectors are the
    chunk's tokens, n <= M (the chunk's rows past them: padding, ignored)."""
    M, T = tile.k.shape
    n = target.shape[0]
    dev = tile.k.device
    f32 = dict(dtype=torch.float32, device=dev)
    lse, nll, smooth = (torch.empty(M, **f32) for _ in range(3))
    has_grad = scales is not None
    cw = class_weight.float().contiguous() if class_weight is not None else None
    smoothing = opts.label_smoothing > 0.0
    rep = exp_gemms.tile_n_for(V) // exp_gemms.STRIP
    if has_grad:
        v, b, cs = (torch.empty(M, **f32) for _ in range(3))
        col = torch.empty(M, dtype=torch.int64, device=dev)
        u, uv = (torch.empty(T * rep, M, dtype=torch.bfloat16, device=dev) for _ in range(2))
        ce_scale, z_scale = (s.float().contiguous() for s in scales)
    else:
        v = b = cs = col = u = uv = ce_scale = z_scale = lse  # unread
    _exp_ce_rows_kernel[(triton.cdiv(M, BLOCK_M),)](
        tile.sum_exp, tile.k, tile.zy, target.contiguous(), lse if cw is None else cw,
        lse if cw is None else cw.sum(), ce_scale, z_scale,
        zsum if smoothing else lse, lse, nll, smooth, v, b, col, cs, u, uv,
        M, n, T, V, opts.ignore_index, opts.label_smoothing,
        REP=rep, HAS_GRAD=has_grad, HAS_CLASS_WEIGHT=cw is not None,
        HAS_SMOOTHING=smoothing, DFT=opts.dft, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T,
        num_warps=4)
    terms = CETerms(lse, nll, smooth, None, None)
    if not has_grad:
        return terms, None
    return terms, exp_gemms.ExpGrad(tile.E, u, uv, v, b, col, cs)

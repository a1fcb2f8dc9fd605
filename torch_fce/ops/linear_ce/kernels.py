"""Triton row kernel: logsumexp, loss terms and the logits gradient of a logits chunk.

One program per token row, two sweeps over the vocabulary: the first forms the
logsumexp online (and the sums label smoothing needs), the second writes the logits
gradient over the logits in place, so a chunk is read twice and written once, in its
own dtype, with no float32 copy (float32 logits of low-precision inputs: dz goes to a
buffer of the inputs' dtype instead, the gradient GEMMs' operand). The math is that of
rows.py (its CERows). The vocab-parallel loss runs the two sweeps as separate kernels
on a shard of the vocabulary (the twins of rows.torch_shard_stats / torch_shard_grad),
its all-reduce of the per-row statistics in between.
"""

import torch
import triton
import triton.language as tl

from ..rowmath.kernels import (_block_max, _block_v, _load_z, _rebased_ez, _sweep_start,
                               dz_buffer)
from .rows import CERows, CETerms


@triton.jit
def _lse_sweep(row_ptr, class_weight_ptr, V, softcap, HAS_SOFTCAP: tl.constexpr,
               HAS_CLASS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               BLOCK_V: tl.constexpr, WANT_STATS: tl.constexpr):
    """Sweep 1: (m, log s, sum_c w_c z_c, argmax, entropy) of one row, m its max and s =
    sum_c exp(z_c - m) formed online (lse = m + log s); the token statistics argmax (the
    first most likely class) and entropy are 0 unless WANT_STATS. The entropy's ez = sum_c exp(z_c - m) (z_c - m) is kept online
    relative to the running max (rebased at each new one, as the log-prob kernel's), so
    a confident row's entropy does not cancel against lse."""
    cols = tl.arange(0, BLOCK_V)
    m, s, best, best_i = _sweep_start(BLOCK_V)
    ez = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    zsum = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        z = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
        bz, best, best_i = _block_max(z, v0, best, best_i, WANT_STATS)
        m_new = tl.maximum(m, bz)
        scale = tl.exp(m - m_new)
        ex = tl.exp(z - m_new)
        if WANT_STATS:
            ez = scale * _rebased_ez(ez, s, m, m_new) + tl.sum(
                tl.where(ex > 0.0, ex * (z - m_new), 0.0), axis=0)
        s = s * scale + tl.sum(ex, axis=0)
        m = m_new
        if HAS_SMOOTHING:
            w = tl.load(class_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32) \
                if HAS_CLASS_WEIGHT else 1.0
            zsum += tl.where(mask, z * w, 0.0)
    log_s = tl.log(s)
    return m, log_s, tl.sum(zsum, axis=0), best_i, log_s - ez / s


@triton.jit
def _grad_sweep(row_ptr, dz_ptr, class_weight_ptr, V, t, m, log_s, a, b, c, softcap,
                HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sweep 2: dz = p * A - B * onehot(t) - C * w, times softcap', into the row at
    dz_ptr (row_ptr itself, or a row of its own in the inputs' dtype), with p =
    exp((z - m) - log s): z - m is exact near the max, so a confident row's gradient
    p_y - 1 keeps float32 precision where exp(z - lse) would carry lse's rounding.

    A row with A = B = C = 0 (an ignored token) gets exactly 0, also when its logits are
    not finite."""
    cols = tl.arange(0, BLOCK_V)
    zero = (a == 0.0) & (b == 0.0) & (c == 0.0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        z = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
        dz = tl.exp((z - m) - log_s) * a - tl.where(offs == t, b, 0.0)
        if HAS_SMOOTHING:
            w = tl.load(class_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32) \
                if HAS_CLASS_WEIGHT else 1.0
            dz -= c * w
        if HAS_SOFTCAP:
            th = z / softcap
            dz *= 1.0 - th * th
        dz = tl.where(zero, 0.0, dz)
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_ce_rows_kernel(
    # pointers
    logits_ptr, dz_ptr, target_ptr, class_weight_ptr, weight_sum_ptr, ce_scale_ptr,
    z_scale_ptr, lse_ptr, nll_ptr, smooth_ptr, argmax_ptr, entropy_ptr,
    # sizes and options
    V, ignore_index, label_smoothing, softcap,
    # strides
    stride_ln, stride_dn,
    # meta-parameters
    HAS_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr, WANT_STATS: tl.constexpr,
    DFT: tl.constexpr,
):
    """logits (n, V) -> lse, nll, smooth (n,) float32 (and argmax (n,) int64 and
    entropy (n,) float32 with WANT_STATS); with HAS_GRAD, dz (the logits themselves, or
    a buffer of its own). With DFT, nll and the CE scale are times the target's p."""
    # int64: row * stride_ln passes 2^31 for chunks of large vocabularies.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    m, log_s, zsum, best, entropy = _lse_sweep(row_ptr, class_weight_ptr, V, softcap,
                                               HAS_SOFTCAP, HAS_CLASS_WEIGHT,
                                               HAS_SMOOTHING, BLOCK_V, WANT_STATS)
    lse = m + log_s
    if WANT_STATS:
        tl.store(argmax_ptr + row, best)
        tl.store(entropy_ptr + row, entropy)

    # ---- per-token terms ----------------------------------------------------------
    t_safe = tl.where(valid & in_range, t, 0)
    z_y = _load_z(row_ptr + t_safe, True, softcap, HAS_SOFTCAP)
    tl.debug_barrier()  # every thread's read before any warp's dz store over it
    w_y = tl.load(class_weight_ptr + t_safe).to(tl.float32) if HAS_CLASS_WEIGHT else 1.0
    # Out-of-range targets never read out of bounds: they poison the row with NaN.
    w_y = tl.where(in_range, w_y, float("nan"))
    w_y = tl.where(valid, w_y, 0.0)
    w_sum = tl.load(weight_sum_ptr).to(tl.float32) if HAS_CLASS_WEIGHT else V * 1.0
    tl.store(lse_ptr + row, lse)
    logp_y = (z_y - m) - log_s  # relative to the max, as the gradient sweep's p
    nll = tl.where(valid, -w_y * logp_y, 0.0)
    p_y = tl.where(valid, tl.exp(logp_y), 0.0) if DFT else 1.0  # rows.dft_weight
    tl.store(nll_ptr + row, nll * p_y)
    smooth = tl.where(valid, w_sum * lse - zsum, 0.0) if HAS_SMOOTHING else 0.0
    tl.store(smooth_ptr + row, smooth)

    if HAS_GRAD:
        s_ce = tl.load(ce_scale_ptr + row) * p_y
        s_z = tl.load(z_scale_ptr + row)
        a = s_ce * ((1.0 - label_smoothing) * w_y + label_smoothing * w_sum / V) \
            + 2.0 * s_z * lse
        a = tl.where((s_ce == 0.0) & (s_z == 0.0), 0.0, a)  # as rows.grad_coefficients
        _grad_sweep(row_ptr, dz_ptr + row * stride_dn, class_weight_ptr, V, t, m, log_s, a,
                    s_ce * (1.0 - label_smoothing) * w_y, s_ce * label_smoothing / V,
                    softcap, HAS_SOFTCAP, HAS_CLASS_WEIGHT, HAS_SMOOTHING, BLOCK_V)


@triton.jit
def _shard_stats_kernel(logits_ptr, col_ptr, class_weight_ptr, lse_ptr, z_y_ptr, zsum_ptr,
                        Vs, softcap, stride_ln, HAS_SOFTCAP: tl.constexpr,
                        HAS_CLASS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    """A vocabulary shard's rows -> the shard's lse, target logit (0 where col < 0) and
    weighted logit sum; the vocab-parallel forward all-reduces these."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    col = tl.load(col_ptr + row).to(tl.int64)
    m, log_s, zsum, _, _ = _lse_sweep(row_ptr, class_weight_ptr, Vs, softcap, HAS_SOFTCAP,
                                      HAS_CLASS_WEIGHT, HAS_SMOOTHING, BLOCK_V, False)
    lse = m + log_s
    z_y = _load_z(row_ptr + tl.maximum(col, 0), True, softcap, HAS_SOFTCAP)
    tl.store(lse_ptr + row, lse)
    tl.store(z_y_ptr + row, tl.where(col >= 0, z_y, 0.0))
    tl.store(zsum_ptr + row, zsum)


@triton.jit
def _shard_grad_kernel(logits_ptr, dz_ptr, col_ptr, class_weight_ptr, lse_ptr, a_ptr, b_ptr,
                       c_ptr, Vs, softcap, stride_ln, stride_dn, HAS_SOFTCAP: tl.constexpr,
                       HAS_CLASS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """A vocabulary shard's dz, from the global lse (as m, with log s = 0) and per-row
    coefficients."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.load(c_ptr + row) if HAS_SMOOTHING else 0.0
    _grad_sweep(logits_ptr + row * stride_ln, dz_ptr + row * stride_dn, class_weight_ptr, Vs,
                tl.load(col_ptr + row).to(tl.int64), tl.load(lse_ptr + row), 0.0,
                tl.load(a_ptr + row), tl.load(b_ptr + row), c, softcap, HAS_SOFTCAP,
                HAS_CLASS_WEIGHT, HAS_SMOOTHING, BLOCK_V)


def _flags(logits, cw, opts):
    """Launch parameters every row kernel shares (logits with unit stride along V)."""
    assert logits.stride(1) == 1
    return dict(HAS_SOFTCAP=opts.softcap is not None, HAS_CLASS_WEIGHT=cw is not None,
                HAS_SMOOTHING=opts.label_smoothing > 0.0, BLOCK_V=_block_v(logits.shape[1]),
                num_warps=8)


def triton_ce_stats(logits, target, class_weight, opts, token_stats, math_dtype):
    """CERows.stats (rows.py) on the Triton kernel: one sweep per row."""
    return _launch_rows(logits, target, class_weight, None, opts, token_stats, math_dtype,
                        None)[0]


def triton_ce_stats_then_grad(logits, target, class_weight, scales, opts, token_stats,
                              math_dtype, dz_dtype):
    """CERows.stats_then_grad on the Triton kernel: two sweeps per row, dz written over
    logits (or into dz_buffer's)."""
    return _launch_rows(logits, target, class_weight, scales, opts, token_stats,
                        math_dtype, dz_dtype)


def _launch_rows(logits, target, class_weight, scales, opts, token_stats, math_dtype,
                 dz_dtype):
    """(CETerms, dz) of logits (n, V) with unit stride along V, target (n,), scales
    None or (ce_scale, z_scale) (n,) float32."""
    n, V = logits.shape
    assert math_dtype == torch.float32
    lse, nll, smooth = (logits.new_empty(n, dtype=torch.float32) for _ in range(3))
    argmax = logits.new_empty(n, dtype=torch.int64) if token_stats else None
    entropy = logits.new_empty(n, dtype=torch.float32) if token_stats else None
    has_grad = scales is not None
    ce_scale, z_scale = scales if has_grad else (lse, lse)
    # The kernel indexes targets and class weights with unit stride; callers may pass
    # views (labels[:, 0], an expanded target), which are copied here.
    target = target.contiguous()
    cw = class_weight.float().contiguous() if class_weight is not None else None
    w_sum = cw.sum() if cw is not None else lse
    dz = dz_buffer(logits, dz_dtype) if has_grad else logits
    _linear_ce_rows_kernel[(n,)](
        logits, dz, target, cw if cw is not None else lse, w_sum, ce_scale, z_scale,
        lse, nll, smooth, argmax if token_stats else lse, entropy if token_stats else lse,
        V, opts.ignore_index, opts.label_smoothing,
        opts.softcap if opts.softcap is not None else 1.0,
        logits.stride(0), dz.stride(0), HAS_GRAD=has_grad, WANT_STATS=token_stats,
        DFT=opts.dft,
        **_flags(logits, cw, opts))
    return CETerms(lse, nll, smooth, argmax, entropy), dz if has_grad else None


def triton_shard_stats(logits, col, cw, opts, math_dtype):
    """Triton twin of rows.torch_shard_stats (col int, -1 where the target is elsewhere)."""
    assert math_dtype == torch.float32
    n, Vs = logits.shape
    lse, z_y, zsum = (logits.new_empty(n, dtype=torch.float32) for _ in range(3))
    cw = None if cw is None else cw.float().contiguous()
    _shard_stats_kernel[(n,)](
        logits, col, lse if cw is None else cw, lse, z_y, zsum, Vs,
        opts.softcap if opts.softcap is not None else 1.0, logits.stride(0),
        **_flags(logits, cw, opts))
    return lse, z_y, zsum if opts.label_smoothing > 0.0 else None


def triton_shard_grad(logits, col, cw, lse, a, b, c, opts, math_dtype, dz_dtype):
    """Triton twin of rows.torch_shard_grad: dz written over logits (or into
    dz_buffer's), returned."""
    assert math_dtype == torch.float32
    cw = None if cw is None else cw.float().contiguous()
    dz = dz_buffer(logits, dz_dtype)
    _shard_grad_kernel[(logits.shape[0],)](
        logits, dz, col, lse if cw is None else cw, lse, a, b, lse if c is None else c,
        logits.shape[1], opts.softcap if opts.softcap is not None else 1.0,
        logits.stride(0), dz.stride(0), **_flags(logits, cw, opts))
    return dz


TRITON_CE_ROWS = CERows(triton_ce_stats, triton_ce_stats_then_grad, triton_shard_stats,
                        triton_shard_grad)

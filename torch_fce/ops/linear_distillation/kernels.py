"""Triton row kernel of the dense distillation loss, the twin of rows.divergence_rows.

One program per token row, sweeping both heads' logits rows (float32 by default, as
the GEMMs summed them): sweep 1 forms both logsumexps at temperature (and the
student's at temperature 1 for the hard loss) online; sweep 2, with them known, forms
each class's log q and log p exactly, summing the divergence, the entropy and (beta >
0) G = sum q g; the gradient is written in sweep 2 for beta = 0 (q - p needs no row
sum) and in a third sweep otherwise (q (g - G) needs G). So a chunk's two logits are
read two or three times and the gradient written once, in the inputs' dtype.
"""

import math

import torch
import triton
import triton.language as tl

from ..rowmath.common import RowMath
from ..rowmath.kernels import _block_v, _load_a, _online, _start, dz_buffer


_WARPS = 8  # the launch's warps (torch_fce/bench/probes/distill_profile.py measures others)


@triton.jit
def _log_probs(a_s, a_t, inv_t, m_s, ls_s, m_t, ls_t, log_1mb, log_b, KIND: tl.constexpr):
    """(log q, log p, g, log m) of a block, relative to each row's max (exact near it,
    so a confident row keeps float32 precision): g the reverse KL's (log q - log p) or
    the JSD's (log q - log m) gradient factor (rows.py), log m the JSD's mixture
    logaddexp(log q + log(1 - beta), log p + log(beta)); 0 where not used."""
    lq = (a_s * inv_t - m_s) - ls_s
    lp = (a_t * inv_t - m_t) - ls_t
    lm = tl.zeros_like(lq)
    if KIND == 1:
        g = lq - lp
    elif KIND == 2:
        x = lq + log_1mb
        y = lp + log_b
        hi = tl.maximum(x, y)
        lm = hi + tl.log(1.0 + tl.exp(tl.minimum(x, y) - hi))
        g = lq - lm
    else:
        g = lm
    return lq, lp, g, lm


@triton.jit
def _dz_block(dz_ptr, offs, mask, a_s, lq, lp, g, G, inv_t, m_h, ls_h, t, w, hard_weight,
              one_m_beta, scale_s, cap_s, HAS_CAP_S: tl.constexpr, KIND: tl.constexpr,
              HARD: tl.constexpr):
    """Writes a block of dz = w * [d div / d u_s / T + hard (softmax(a_s) - onehot)] *
    d a_s / d z (w = 0 for a token not counted: exactly 0, whatever its logits)."""
    q = tl.exp(lq)
    if KIND == 0:
        d = q - tl.exp(lp)
    else:
        d = tl.where(q > 0.0, q * (one_m_beta * g - G), 0.0)
    d = d * inv_t
    if HARD:
        d += hard_weight * (tl.exp((a_s - m_h) - ls_h) - tl.where(offs == t, 1.0, 0.0))
    if HAS_CAP_S:
        th = a_s / cap_s
        d *= scale_s * (1.0 - th * th)
    else:
        d *= scale_s
    d = tl.where(w != 0.0, d * w, 0.0)
    tl.store(dz_ptr + offs, d.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _distill_rows_kernel(
    # pointers
    zs_ptr, zt_ptr, dz_ptr, target_ptr, inv_t_ptr, w_ptr, loss_ptr, div_ptr, ent_ptr,
    # sizes and options
    V, ignore_index, beta, log_1mb, log_b, hard_weight, scale_s, scale_t, cap_s, cap_t,
    # strides
    stride_s, stride_t, stride_d,
    # meta-parameters
    KIND: tl.constexpr, HAS_TARGET: tl.constexpr, HARD: tl.constexpr,
    HAS_GRAD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Both heads' logits rows (n, V) -> loss_t, divergence, entropy (n,) float32 and,
    with HAS_GRAD, the student's dz. KIND: 0 beta = 0, 1 beta = 1, 2 between."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    dz_row = dz_ptr + row * stride_d
    cols = tl.arange(0, BLOCK_V)
    inv_t = tl.load(inv_t_ptr + row)
    if HAS_TARGET:
        t = tl.load(target_ptr + row).to(tl.int64)
        valid = t != ignore_index
    else:
        t = tl.full([], -1, tl.int64)
        valid = t == t
    w = tl.where(valid, tl.load(w_ptr + row), 0.0)

    # sweep 1: the logsumexps of u_s = a_s / T, u_t = a_t / T (and a_s for the hard loss)
    m_s, s_s = _start(BLOCK_V)
    m_t, s_t = _start(BLOCK_V)
    m_h, s_h = _start(BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        a_s = _load_a(zs_row + offs, mask, scale_s, cap_s, HAS_CAP_S)
        a_t = _load_a(zt_row + offs, mask, scale_t, cap_t, HAS_CAP_T)
        m_s, s_s = _online(m_s, s_s, a_s * inv_t)
        m_t, s_t = _online(m_t, s_t, a_t * inv_t)
        if HARD:
            m_h, s_h = _online(m_h, s_h, a_s)
    ls_s = tl.log(s_s)
    ls_t = tl.log(s_t)
    ls_h = tl.log(s_h)
    # the hard loss -log softmax(a_s)[t], relative to the max (read before dz may be
    # written over the logits)
    ce = 0.0
    if HARD:
        in_range = (t >= 0) & (t < V)
        a_y = _load_a(zs_row + tl.where(valid & in_range, t, 0), True, scale_s, cap_s,
                      HAS_CAP_S)
        tl.debug_barrier()  # every thread's read before any warp's dz store over it
        # out-of-range targets never read out of bounds: they poison the row with NaN
        ce = tl.where(in_range, ls_h - (a_y - m_h), float("nan"))

    # sweep 2: the divergence, entropy and G = sum q g (and dz for beta = 0)
    div = tl.zeros([BLOCK_V], tl.float32)
    ent = tl.zeros([BLOCK_V], tl.float32)
    G = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        a_s = _load_a(zs_row + offs, mask, scale_s, cap_s, HAS_CAP_S)
        a_t = _load_a(zt_row + offs, mask, scale_t, cap_t, HAS_CAP_T)
        lq, lp, g, lm = _log_probs(a_s, a_t, inv_t, m_s, ls_s, m_t, ls_t, log_1mb, log_b,
                                   KIND)
        q = tl.exp(lq)
        p = tl.exp(lp)
        ent += tl.where(q > 0.0, q * lq, 0.0)
        if KIND == 0:
            div += tl.where(p > 0.0, p * (lp - lq), 0.0)
            if HAS_GRAD:
                _dz_block(dz_row, offs, mask, a_s, lq, lp, g, 0.0, inv_t, m_h, ls_h, t, w,
                          hard_weight, 1.0, scale_s, cap_s, HAS_CAP_S, KIND, HARD)
        elif KIND == 1:
            qg = tl.where(q > 0.0, q * g, 0.0)
            div += qg
            G += qg
        else:  # beta KL(p || m) + (1 - beta) KL(q || m)
            qg = tl.where(q > 0.0, q * g, 0.0)
            div += beta * tl.where(p > 0.0, p * (lp - lm), 0.0) + (1.0 - beta) * qg
            G += qg
    div_r = tl.sum(div, axis=0)
    G_r = tl.sum(G, axis=0) * (1.0 - beta) if KIND == 2 else tl.sum(G, axis=0)

    # sweep 3 (beta > 0): dz = q ((1 - beta) g - G) / T + the hard loss's
    if HAS_GRAD and KIND != 0:
        one_m_beta = 1.0 - beta if KIND == 2 else 1.0
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            mask = offs < V
            a_s = _load_a(zs_row + offs, mask, scale_s, cap_s, HAS_CAP_S)
            a_t = _load_a(zt_row + offs, mask, scale_t, cap_t, HAS_CAP_T)
            lq, lp, g, _ = _log_probs(a_s, a_t, inv_t, m_s, ls_s, m_t, ls_t, log_1mb,
                                      log_b, KIND)
            _dz_block(dz_row, offs, mask, a_s, lq, lp, g, G_r, inv_t, m_h, ls_h, t, w,
                      hard_weight, one_m_beta, scale_s, cap_s, HAS_CAP_S, KIND, HARD)

    tl.store(loss_ptr + row, tl.where(valid, w * (div_r + hard_weight * ce), 0.0))
    tl.store(div_ptr + row, tl.where(valid, div_r, 0.0))
    tl.store(ent_ptr + row, tl.where(valid, -tl.sum(ent, axis=0), 0.0))


def triton_divergence_rows(z_s, z_t, target, valid, inv_t, weights, opts, mdt, dz_dtype,
                           want_grad):
    """rows.divergence_rows on the Triton kernel (valid is read from target)."""
    n, V = z_s.shape
    assert mdt == torch.float32 and z_s.stride(1) == 1 and z_t.stride(1) == 1
    loss_t, div, ent = (z_s.new_empty(n, dtype=torch.float32) for _ in range(3))
    dz = dz_buffer(z_s, dz_dtype) if want_grad else z_s
    beta = float(opts.beta)
    kind = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    mixed = kind == 2
    _distill_rows_kernel[(n,)](
        z_s, z_t, dz, loss_t if target is None else target, inv_t.float().contiguous(),
        weights.float().contiguous(), loss_t, div, ent,
        V, opts.ignore_index, beta, math.log1p(-beta) if mixed else 0.0,
        math.log(beta) if mixed else 0.0, float(opts.hard_weight), float(opts.logit_scale),
        float(opts.teacher_logit_scale), float(opts.softcap or 1.0),
        float(opts.teacher_softcap or 1.0), z_s.stride(0), z_t.stride(0), dz.stride(0),
        KIND=kind, HAS_TARGET=target is not None, HARD=opts.hard_weight != 0.0,
        HAS_GRAD=want_grad, HAS_CAP_S=opts.softcap is not None,
        HAS_CAP_T=opts.teacher_softcap is not None, BLOCK_V=_block_v(V), num_warps=_WARPS)
    return loss_t, div, ent, dz if want_grad else None


ROWS = RowMath(triton_divergence_rows, temporaries=0)

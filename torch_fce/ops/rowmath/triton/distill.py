"""Triton row kernels for the distillation family: the twins of
distill.divergence_rows and soft_ce_rows.

One program per token row, sweeping both heads' logits rows (float32 by default, as
the GEMMs summed them): sweep 1 forms both logsumexps at temperature (and the
student's at temperature 1 for the hard loss) online; sweep 2, with them known, forms
each class's log q and log p exactly, summing the divergence, the entropy and (beta >
0) G = sum q g; the gradient is written in sweep 2 for beta = 0 (q - p needs no row
sum) and in a third sweep otherwise (q (g - G) needs G). So a chunk's two logits are
read two or three times and the gradient written once, in the inputs' dtype.

The sparse-target cross entropy's kernel sweeps a row twice, forming its logsumexp at T
and writing P q / T w_t, q = softmax(z / T); the k target classes' exact values (P q -
sum of their p) / T w_t are then written over theirs from the gathered logits, each
rounded once.
"""

import math

import torch
import triton
import triton.language as tl

from ..distill import DistillRows, RowMath, sparse_targets
from .ce import _NEG_BIG, _block_v, _tanh, dz_buffer

_WARPS = 8  # the launch's warps (torch_fce/bench/probes/distill_profile.py measures others)


@triton.jit
def _load_a(ptrs, mask, scale, cap, HAS_CAP: tl.constexpr):
    """a = softcap(scale * z) in float32, -inf where masked."""
    a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_CAP:
        a = cap * _tanh(a / cap)
    return tl.where(mask, a, float("-inf"))


@triton.jit
def _online(m, s, x):
    """The running (max, sum of exp(x - max)) of a row after block x."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    return m_new, s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)


@triton.jit
def _start(BLOCK_V: tl.constexpr):
    """An online logsumexp's start as scalars: a finite lowest max (m_old - m_new stays
    a number for rows that are -inf so far) and a zero sum."""
    return (tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0),
            tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0))


@triton.jit
def _log_probs(a_s, a_t, inv_t, m_s, ls_s, m_t, ls_t, log_1mb, log_b, KIND: tl.constexpr):
    """(log q, log p, g, log m) of a block, relative to each row's max (exact near it,
    so a confident row keeps float32 precision): g the reverse KL's (log q - log p) or
    the JSD's (log q - log m) gradient factor (rowmath/distill.py), log m the JSD's mixture
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


@triton.jit
def _soft_ce_rows_kernel(z_ptr, dz_ptr, inv_t_ptr, a_ptr, m_ptr, ls_ptr, V, stride_z,
                         stride_d, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Logits rows (n, V) -> m, log s (n,) of u = z / T (lse = m + log s) and, with
    HAS_GRAD, dz = a softmax(u) (a = P w_t / T: exactly 0 where a is)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    inv_t = tl.load(inv_t_ptr + row)
    m, s = _start(BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        m, s = _online(m, s, _load_a(z_row + offs, offs < V, inv_t, 1.0, False))
    ls = tl.log(s)
    tl.store(m_ptr + row, m)
    tl.store(ls_ptr + row, ls)
    if HAS_GRAD:
        a = tl.load(a_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            mask = offs < V
            u = _load_a(z_row + offs, mask, inv_t, 1.0, False)
            d = tl.where(a != 0.0, tl.exp((u - m) - ls) * a, 0.0)
            tl.store(dz_ptr + row * stride_d + offs, d.to(dz_ptr.dtype.element_ty), mask=mask)


def triton_soft_ce_rows(z, idx, probs, inv_t, weights, opts, mdt, dz_dtype, want_grad):
    """distill.soft_ce_rows on the Triton kernel, the target classes' values
    formed from their gathered logits."""
    n, V = z.shape
    assert mdt == torch.float32 and z.stride(1) == 1
    skip, valid, safe, p = sparse_targets(idx, probs, V, opts.ignore_index, torch.float32)
    inv_t = inv_t.float().contiguous()
    z_k = z.gather(1, safe).float() * inv_t[:, None]  # before dz may be written over z
    w = torch.where(valid, weights.float(), 0.0)
    c = w * inv_t
    a = p.sum(-1) * c
    m, ls = (z.new_empty(n, dtype=torch.float32) for _ in range(2))
    dz = dz_buffer(z, dz_dtype) if want_grad else z
    _soft_ce_rows_kernel[(n,)](z, dz, inv_t, a, m, ls, V, z.stride(0), dz.stride(0),
                               HAS_GRAD=want_grad, BLOCK_V=_block_v(V), num_warps=_WARPS)
    log_q = (z_k - m[:, None]) - ls[:, None]  # relative to the max, as the kernel's
    loss_t = -w * torch.where(skip, 0.0, p * log_q).sum(-1)
    if not want_grad:
        return loss_t, None
    # each target class's p summed over the entries naming it (duplicates; a skipped
    # entry names column 0, whose value is then written exactly too)
    same = (safe[:, :, None] == safe[:, None, :]) & ~skip[:, None, :]
    p_sum = torch.where(same, p[:, None, :], 0.0).sum(-1)
    exact = torch.where(valid[:, None], a[:, None] * log_q.exp() - c[:, None] * p_sum, 0.0)
    return loss_t, dz.scatter_(1, safe, exact.to(dz.dtype))


def triton_divergence_rows(z_s, z_t, target, valid, inv_t, weights, opts, mdt, dz_dtype,
                           want_grad):
    """distill.divergence_rows on the Triton kernel (valid is read from target)."""
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


TRITON_DISTILL_ROWS = DistillRows(RowMath(triton_divergence_rows, temporaries=0),
                                  RowMath(triton_soft_ce_rows, temporaries=0))

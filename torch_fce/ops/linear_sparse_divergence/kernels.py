"""Triton twin of rows.sparse_divergence_rows: the sparse divergence in one row kernel
(with the tail, or renormalised over the support: a kernel each), its terms written out
(its per-chunk PyTorch math on (n, K) tensors left an H200 waiting on the host: 46-65 ms
a step at 16384 x 1024 x 151936 against 31-32 ms with 4x larger chunks); a vocabulary
shard's sums in a kernel of their own, all-reduced before it."""

import torch
import triton
import triton.language as tl

from ..loop.chunked import ONE_DEVICE
from ..loop.sparse import SparseGrad
from ..rowmath.common import RowMath, all_reduce_sums
from ..rowmath.kernels import _block_v, _load_a, dz_over
from ..rowmath.sparse_rows_kernels import _WARPS, _row_sums, _softmax_sweep
from .sums_kernels import (_TAIL_MAX, _expm1, _jsd_entry, _load_part, _local, _log1p,
                           _marked_sums, _masked_lse, _multiplicity, _sparse_sums_kernel,
                           _support_block)


@triton.jit
def _support_log_probs(a_k, inv_t, m, ls, entries, bad, tch, w_ptr, row):
    """(log_q, counted, w, s, t, lse_s) of a row's support: the student's log-probs
    relative to the max, whether the token is counted and its weight, the entries'
    student and teacher log-probs (-inf off them, NaN at an out-of-range one) and the
    student's log-mass on them."""
    log_q = (a_k * inv_t - m) - ls
    counted = tl.sum(entries.to(tl.int32), axis=0) > 0
    w = tl.where(counted, tl.load(w_ptr + row), 0.0)
    s = tl.where(entries, tl.where(bad, float("nan"), log_q), float("-inf"))
    t = tl.where(entries, tch, float("-inf"))
    return log_q, counted, w, s, t, _masked_lse(s, entries)


@triton.jit
def _store_outputs(out_ptr, n, row, counted, w, div, log_q, entries, bad, ent):
    """out (4, n): loss_t, divergence, the student's mass on the support and entropy, 0
    at a token not counted; the divergence NaN where an entry is out of range (its
    nan_to_num would hide it)."""
    mass = tl.sum(tl.where(entries, tl.exp(tl.where(bad, float("nan"), log_q)), 0.0), axis=0)
    div = tl.where(tl.sum(bad.to(tl.int32), axis=0) > 0, float("nan"), div)
    tl.store(out_ptr + row, tl.where(counted, w * div, 0.0))
    tl.store(out_ptr + n + row, tl.where(counted, div, 0.0))
    tl.store(out_ptr + 2 * n + row, tl.where(counted, mass, 0.0))
    tl.store(out_ptr + 3 * n + row, tl.where(counted, ent, 0.0))


@triton.jit
def _tail_kernel(
    # pointers
    z_ptr, dz_ptr, support_ptr, teacher_ptr, tail_ptr, inv_t_ptr, w_ptr, out_ptr, g_ptr,
    part_ptr,
    # sizes and options
    n, V, V_all, start, K, ignore_index, beta, scale, cap, stride_z,
    # meta-parameters
    KIND: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_CAP: tl.constexpr, OVER: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    FROM_PART: tl.constexpr,
):
    """rows.sparse_divergence_rows with the tail bucket, one program a row: the sums
    over the row (the student's mass off the support summed directly, _marked_sums;
    FROM_PART: _sparse_sums_kernel's, all-reduced across a shard group, with the
    support's logits in the scratch), the support's log-probs, the divergence and its
    derivative g on them (as autograd forms _divergence's), then the softmax sweep of dz
    and the support classes' exact values over theirs (g summed over duplicate classes
    through the row's g scratch). out (4, n): loss_t, divergence, mass, entropy. The
    row's classes are [start, start + V) of V_all (one device: 0 and V); dz is written
    over the logits (OVER: 16-bit over float32, row stride 2 stride_z)."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31
    z_row = z_ptr + row * stride_z
    inv_t = tl.load(inv_t_ptr + row)
    ks = tl.arange(0, BLOCK_K)
    g_row = g_ptr + row * BLOCK_K  # the row's scratch
    one_m_beta = 1.0 - beta
    # the student's mass off the support summed directly, the support's distinct classes
    # (and other -inf logits) added back after it; its logits wait in the scratch, the
    # support is read again after the sweep (no vector held across it)
    if FROM_PART:
        m_n, s_n, t_n, n_inf = _load_part(part_ptr, n, row)
    else:
        m_n, s_n, t_n, n_inf = _marked_sums(z_row, g_row, support_ptr, teacher_ptr, row, K,
                                            ks, V, V_all, start, ignore_index, inv_t, scale,
                                            cap, HAS_CAP, BLOCK_V)
    entries, bad, safe, tch = _support_block(support_ptr, teacher_ptr, row, K, ks, V_all,
                                             ignore_index)
    valid = entries & ~bad
    a_k = tl.load(g_row + ks)
    mult = _multiplicity(support_ptr, teacher_ptr, row, K, V_all, ignore_index, safe,
                         BLOCK_K, SUB_K)
    u_k = tl.where(valid, a_k * inv_t, float("-inf"))
    once = tl.where(valid, 1.0 / mult, 0.0)  # each distinct class once
    # -inf logits off the support: softcap(-inf) / T each (-inf without softcap)
    n_gen = tl.floor(n_inf - tl.sum(once, axis=0) + 0.5)
    u_inf = tl.full([], float("-inf"), tl.float32)
    if HAS_CAP:
        u_inf = tl.where(n_gen > 0.5, -cap * inv_t, u_inf)
    m = tl.maximum(tl.maximum(m_n, tl.max(u_k, axis=0)), u_inf)
    r = tl.exp(m_n - m)
    e_k = tl.where(valid, tl.exp(u_k - m), 0.0)
    e_inf = tl.where(n_gen > 0.5, n_gen * tl.exp(u_inf - m), 0.0)
    S = s_n * r + e_inf + tl.sum(e_k * once, axis=0)
    # (0 log 0 = 0: a -inf logit of the support adds nothing)
    T = r * (t_n + (m_n - m) * s_n) + tl.where(e_inf > 0.0, e_inf * (u_inf - m), 0.0) \
        + tl.sum(tl.where(valid & (e_k > 0.0), e_k * once * (u_k - m), 0.0), axis=0)
    ls = tl.log(S)
    ent = ls - T / S
    # TRL's 1 - sum over the entries (duplicates each counted): the mass off the support
    # less the duplicates' excess, exactly 0 for a class named once whatever the
    # division's rounding (the GPU's fp32 division is not IEEE's: 1 / 1 is not promised
    # to be 1, and the rest cancels here when it is small)
    excess = tl.where(valid, e_k * ((mult - 1.0) / mult), 0.0)
    rest = (s_n * r + e_inf - tl.sum(excess, axis=0)) / S
    log_q, counted, w, s, t, lse_s = _support_log_probs(a_k, inv_t, m, ls, entries, bad, tch,
                                                        w_ptr, row)
    # the entries' log-mass from the rest where it is small (precise there), NaN kept; the
    # (K+1)-th bucket log(1 - sum exp), its log-sum clamped below -1e-7 (the clamp as
    # torch's: NaN stays NaN; its derivative 0 above)
    near = (rest < 0.5) & (lse_s == lse_s)
    lse_s = tl.where(near, _log1p(-rest), lse_s)
    l_s = tl.where(lse_s > _TAIL_MAX, _TAIL_MAX, lse_s)
    em_s = tl.where(near & (lse_s <= _TAIL_MAX), -rest, _expm1(l_s))
    tail_t = tl.load(tail_ptr + row)  # the teacher's (rows.teacher_tail)
    term, d = _jsd_entry(s, t, beta, one_m_beta, KIND)
    term_b, d_b = _jsd_entry(tl.log(-em_s), tail_t, beta, one_m_beta, KIND)
    div = tl.sum(tl.where(entries, term, 0.0), axis=0) + term_b
    # d loss / d the entries' log-mass (through the bucket), kept apart from d
    d_l = tl.where(counted & (lse_s <= _TAIL_MAX), w * d_b * (em_s + 1.0) / em_s, 0.0)
    g = tl.where(entries & counted, w * d, 0.0)
    _store_outputs(out_ptr, n, row, counted, w, div, log_q, entries, bad, ent)

    if HAS_GRAD:
        c = inv_t * scale  # d u / d (scale z), times scale
        G = tl.sum(g, axis=0)
        coef = -(G + d_l) * c  # the softmax part: d l / d u sums to 1 over the row
        tl.debug_barrier()  # every warp's read of the support's logits first
        tl.store(g_row + ks, g)
        tl.debug_barrier()  # the scratch's stores before the reads below
        sums = tl.zeros([BLOCK_K], tl.float32)  # g summed over the entries of each class
        for j0 in range(0, BLOCK_K, SUB_K):
            jj = j0 + tl.arange(0, SUB_K)
            _, _, safe_j, _ = _support_block(support_ptr, teacher_ptr, row, K, jj, V_all,
                                             ignore_index)
            g_j = tl.load(g_row + jj)
            sums += tl.sum(tl.where(safe[:, None] == safe_j[None, :], g_j[None, :], 0.0),
                           axis=1)
        # a support class's value written whole: d_l's parts of the softmax term and of
        # the entries' cancel to -d_l q (one entry a class), which their sum would leave
        # at float32's rounding of d_l q / rest; another class's: the sweep's
        q_k = tl.exp(log_q)
        sig = tl.exp(log_q - lse_s)  # q / (1 - rest): d lse_s / d u at the class
        exact = c * (sums - q_k * G + tl.where(mult > 0.0,
                                               d_l * (mult - 1.0 + rest) * sig, 0.0))
        exact = tl.where(mult > 0.0, exact, coef * q_k)
        if HAS_CAP:
            th = a_k / cap
            exact *= 1.0 - th * th
        # a row without gradient (a token not counted): exactly 0, as its sweep wrote
        zero = (tl.sum((g != 0.0).to(tl.int32), axis=0) == 0) & (d_l == 0.0)
        exact = tl.where(zero, 0.0, exact)
        tl.debug_barrier()  # the reads of g before it is overwritten
        tl.store(g_row + ks, exact)  # held in the scratch across the sweep
        dz_row = dz_ptr + row * (2 * stride_z if OVER else stride_z)  # dz_over's view
        _softmax_sweep(z_row, dz_row, V, inv_t, m, ls, coef, scale, cap, HAS_CAP, OVER,
                       BLOCK_V)
        tl.debug_barrier()  # the sweep's and the scratch's stores before the ones below
        entries, bad, safe, tch = _support_block(support_ptr, teacher_ptr, row, K, ks,
                                                 V_all, ignore_index)
        here, col = _local(safe, ks, K, start, V)
        tl.store(dz_row + col, tl.load(g_row + ks).to(dz_row.dtype.element_ty), mask=here)


@triton.jit
def _renormalised_kernel(
    # pointers
    z_ptr, support_ptr, teacher_ptr, inv_t_ptr, w_ptr, out_ptr, g_ptr, cols_ptr, part_ptr,
    # sizes and options
    n, V, V_all, start, K, ignore_index, beta, scale, cap, stride_z,
    # meta-parameters
    KIND: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_CAP: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, FROM_PART: tl.constexpr,
):
    """rows.sparse_divergence_rows without the tail (both distributions renormalised
    over the support), one program a row: the row's logsumexp and entropy sums
    (FROM_PART: _sparse_sums_kernel's, all-reduced, with the support's logits in the
    scratch), the support's log-probs, the divergence and its derivative g on them; the
    gradient is the support's entries alone (g sums to 0: no softmax part), loop/
    sparse.py's SparseGrad: values into g, columns into cols, both (n, BLOCK_K). out (4,
    n) as _tail_kernel's."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31
    z_row = z_ptr + row * stride_z
    inv_t = tl.load(inv_t_ptr + row)
    ks = tl.arange(0, BLOCK_K)
    g_row = g_ptr + row * BLOCK_K  # the row's scratch (a shard's) and its values
    if FROM_PART:
        m, s_all, t_all, _ = _load_part(part_ptr, n, row)
    else:
        m, s_all, t_all = _row_sums(z_row, V, inv_t, scale, cap, HAS_CAP, True, BLOCK_V)
    ls = tl.log(s_all)
    ent = ls - t_all / s_all
    entries, bad, safe, tch = _support_block(support_ptr, teacher_ptr, row, K, ks, V_all,
                                             ignore_index)
    here, col = _local(safe, ks, K, start, V)
    if FROM_PART:
        a_k = tl.load(g_row + ks)
    else:
        a_k = _load_a(z_row + col, here, scale, cap, HAS_CAP)
    log_q, counted, w, s, t, lse_s = _support_log_probs(a_k, inv_t, m, ls, entries, bad, tch,
                                                        w_ptr, row)
    sig = tl.where(entries, tl.exp(s - lse_s), 0.0)  # d lse_s / d s
    term, d = _jsd_entry(s - lse_s, t - _masked_lse(t, entries), beta, 1.0 - beta, KIND)
    div = tl.sum(tl.where(entries, term, 0.0), axis=0)
    g = d - sig * tl.sum(tl.where(entries, d, 0.0), axis=0)
    g = tl.where(entries & counted, w * g, 0.0)
    _store_outputs(out_ptr, n, row, counted, w, div, log_q, entries, bad, ent)

    if HAS_GRAD:
        v = g * inv_t * scale  # d u / d (scale z), times scale
        if HAS_CAP:
            th = a_k / cap
            v *= 1.0 - th * th
        if FROM_PART:
            tl.debug_barrier()  # every warp's read of the scratch's logits first
        tl.store(g_row + ks, tl.where(here & (g != 0.0), v, 0.0))
        tl.store(cols_ptr + row * BLOCK_K + ks, col)


def triton_sparse_divergence_rows(z, support, teacher, tail_t, inv_t, weights, opts, mdt,
                                  dz_dtype, want_grad, shard=ONE_DEVICE):
    """rows.sparse_divergence_rows in one Triton kernel, with the tail or without (the
    formula and its derivative written by hand, as rows._divergence and autograd form
    them); a vocabulary shard's in two, its sums and support logits all-reduced in
    between (all_reduce_sums)."""
    n, V = z.shape
    assert mdt == torch.float32 and z.stride(1) == 1
    K = support.shape[1]
    block_k = triton.next_power_of_2(max(K, 1))
    out = z.new_empty((4, n), dtype=torch.float32)
    dense = want_grad and opts.tail  # without the tail: a SparseGrad (g, cols)
    dz = dz_over(z, dz_dtype) if dense else z
    sharded = shard.group is not None
    # the values without the tail, the scratch with it or on a shard
    g = z.new_empty((n, block_k), dtype=torch.float32) if want_grad or opts.tail or \
        sharded else out
    cols = z.new_empty((n, block_k), dtype=torch.int64) if want_grad and not dense else g
    # the teacher's tail, formed in float64 by the op (in the kernel its float64 math
    # took registers)
    tail = tail_t.contiguous() if opts.tail else out
    beta = float(opts.beta)
    support, teacher = support.contiguous(), teacher.contiguous()
    inv_t = inv_t.float().contiguous()
    # this rank's classes: V of V_all from start (one device: V of V from 0)
    classes = (V, V if not sharded else shard.vocab_size, shard.vocab_start, K,
               opts.ignore_index)
    options = (float(opts.logit_scale), float(opts.softcap or 1.0))
    flags = dict(HAS_CAP=opts.softcap is not None, BLOCK_V=_block_v(V), BLOCK_K=block_k)
    part = out
    if n and sharded:
        part = z.new_empty((4, n), dtype=torch.float32)
        _sparse_sums_kernel[(n,)](z, support, teacher, inv_t, g, part, n, *classes, *options,
                                  z.stride(0), TAIL=bool(opts.tail), **flags,
                                  num_warps=_WARPS)
        m, s, t, *more = all_reduce_sums(*part[:3], shard, part[3], *g.T)
        part.copy_(torch.stack([m, s, t, more[0]]))
        g.copy_(torch.stack(more[1:], 1))
    weights = weights.float().contiguous()
    kind = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    if n and opts.tail:
        over = dz.dtype != z.dtype  # 16-bit dz over float32 logits: row stride 2 z's
        assert dz.stride(0) == (2 if over else 1) * z.stride(0)
        _tail_kernel[(n,)](
            z, dz, support, teacher, tail, inv_t, weights, out, g, part, n, *classes, beta,
            *options, z.stride(0), KIND=kind, HAS_GRAD=want_grad, OVER=over,
            SUB_K=min(block_k, 16), FROM_PART=sharded, **flags, num_warps=_WARPS)
    elif n:
        _renormalised_kernel[(n,)](
            z, support, teacher, inv_t, weights, out, g, cols, part, n, *classes, beta,
            *options, z.stride(0), KIND=kind, HAS_GRAD=want_grad, FROM_PART=sharded,
            **flags, num_warps=_WARPS)
    if not want_grad:
        return tuple(out), None
    return tuple(out), dz if dense else SparseGrad(cols, g)


ROWS = RowMath(triton_sparse_divergence_rows, temporaries=0, dz_over=True)

"""Triton row kernel for the log-probs: the statistics, argmax and target logit of a
block of classes, and the logits gradient of a logits chunk (the math of
logprob_rows.torch_logprob_rows).

One program per token row. The forward sweeps a row (or a vocabulary tile of it) once,
forming its logprob_rows.TileStats online; the backward, given the forward's row
statistics relative to the row max (logprob_rows.py), sweeps it once more, writing the
logits gradient over the recomputed logits in place: each pass reads a chunk once (and
the backward writes it once), in its own dtype.
"""

import torch
import triton
import triton.language as tl

from ..logprob_rows import TileStats, finish_stats
from .rows import _NEG_BIG, _argmax_update, _block_v, _load_z


@triton.jit
def _stats_sweep(row_ptr, V, inv_t, softcap, HAS_SOFTCAP: tl.constexpr,
                 WANT_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """(m, s, ez, best, argmax) of one row of z = softcap(l) * inv_t: the max, s =
    sum_c exp(z_c - m), ez = sum_c exp(z_c - m) (z_c - m) (0 unless WANT_ENTROPY), the
    max of softcap(l) and its first column.

    ez kept online has no 0 * -inf for masked or -inf logits, and no cancellation
    against m for confident rows."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    ez = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    best = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    best_i = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        c = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
        # argmax of softcap(l) (the same class as of z for inv_t > 0), first one on ties
        best, best_i = _argmax_update(c, v0, best, best_i)
        z = c * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        ex = tl.where(mask, tl.exp(z - m_new), 0.0)
        if WANT_ENTROPY:  # ez = sum_c exp(z_c - m) (z_c - m), rebased to the new max
            ez = scale * (ez + (m - m_new) * s) + tl.sum(
                tl.where(ex > 0.0, ex * (z - m_new), 0.0), axis=0)
        s = s * scale + tl.sum(ex, axis=0)
        m = m_new
    return m, s, ez, best, best_i


@triton.jit
def _linear_logprobs_rows_kernel(
    # pointers
    logits_ptr, target_ptr, inv_t_ptr, g_lp_ptr, g_h_ptr, stats_ptr, best_ptr, argmax_ptr,
    z_y_ptr,
    # sizes and options
    V, col0, ignore_index, softcap,
    # strides
    stride_ln,
    # meta-parameters
    HAS_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, WANT_ENTROPY: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The logits (n, V) are the classes [col0, col0 + V). Without HAS_GRAD (the
    forward): their TileStats, (m, s, ez) into stats (n, 3), best, argmax (whole-
    vocabulary) and z_y. With HAS_GRAD (the backward): logits <- dl for upstream g_lp
    (and, with HAS_ENTROPY_GRAD, g_h), from the forward's row statistics (n, 3) (m,
    log s, d)."""
    # int64: row * stride_ln passes 2^31 for chunks of large vocabularies.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    t = tl.load(target_ptr + row).to(tl.int64)
    inv_t = tl.load(inv_t_ptr + row)
    valid = t != ignore_index
    if not HAS_GRAD:
        m, s, ez, best, best_i = _stats_sweep(row_ptr, V, inv_t, softcap, HAS_SOFTCAP,
                                              WANT_ENTROPY, BLOCK_V)
        here = (t >= col0) & (t < col0 + V)
        z_y = _load_z(row_ptr + tl.where(here, t - col0, 0), True, softcap,
                      HAS_SOFTCAP) * inv_t
        tl.store(z_y_ptr + row, tl.where(here, z_y, 0.0))
        tl.store(best_ptr + row, best)
        tl.store(argmax_ptr + row, best_i + col0)
        tl.store(stats_ptr + row * 3, m)
        tl.store(stats_ptr + row * 3 + 1, s)
        tl.store(stats_ptr + row * 3 + 2, ez)
    else:
        m = tl.load(stats_ptr + row * 3)
        log_s = tl.load(stats_ptr + row * 3 + 1)
        g = tl.where(valid, tl.load(g_lp_ptr + row), 0.0)
        if HAS_ENTROPY_GRAD:
            h = tl.where(valid, tl.load(g_h_ptr + row), 0.0)
            d = tl.load(stats_ptr + row * 3 + 2)
        cols = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            mask = offs < V
            c = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
            zm = c * inv_t - m  # exact near the max
            p = tl.exp(zm - log_s)
            if HAS_ENTROPY_GRAD:  # p = 0 where z = -inf: no 0 * -inf
                dz = -p * g - tl.where(p > 0.0, p * h * (zm - d), 0.0)
            else:
                dz = -p * g
            dz += tl.where(offs + col0 == t, g, 0.0)
            dz *= inv_t
            if HAS_SOFTCAP:
                th = c / softcap
                dz *= 1.0 - th * th
            dz = tl.where(valid, dz, 0.0)  # ignored rows: 0 even if their logits are not finite
            tl.store(row_ptr + offs, dz.to(row_ptr.dtype.element_ty), mask=mask)


def triton_logprob_rows(logits, target, inv_t, opts, entropy, grad, math_dtype, col0=None):
    """Row function for chunked.linear_logprobs_*, as logprob_rows.torch_logprob_rows:
    without grad (logprob, entropy, lse, argmax, row_stats, None) (entropy undefined
    unless asked for), or with col0 a vocabulary tile's TileStats; with grad = (g_lp,
    g_h, row_stats), (None,) * 5 + (dz,), dz written over logits (a tile's with col0).
    logits (n, V) with unit stride along V; target, inv_t, g_lp and g_h (n,), row_stats
    (n, 3). With grad a function (logprob, entropy) -> (g_lp, g_h) (a loss formed in
    the forward): the forward's outputs and dz for those gradients, from a forward sweep
    and a gradient sweep over the chunk."""
    assert math_dtype == torch.float32
    first = 0 if col0 is None else col0
    if grad is not None and not callable(grad):
        return (None,) * 5 + (_launch(logits, target, inv_t, opts, entropy, grad, first),)
    stats = _launch(logits, target, inv_t, opts, entropy, None, first)
    if col0 is not None:
        return stats
    outputs = finish_stats(stats, target, logits.shape[1], opts.ignore_index, entropy)
    if grad is None:
        return (*outputs, None)
    g_lp, g_h = grad(outputs[0], outputs[1])
    dz = _launch(logits, target, inv_t, opts, False, (g_lp, g_h, outputs[4]), 0)
    return (*outputs, dz)


def _launch(logits, target, inv_t, opts, entropy, grad, col0):
    """One launch of the kernel: the forward sweep (TileStats), or the gradient sweep
    for grad = (g_lp, g_h, row_stats) (dz, over the logits)."""
    n, V = logits.shape
    assert logits.stride(1) == 1
    # Unit-stride indexing in the kernel: views (an expanded temperature) are copied.
    target, inv_t = target.contiguous(), inv_t.float().contiguous()
    if grad is None:
        stats = logits.new_empty(n, 3, dtype=torch.float32)
        best, z_y = (logits.new_empty(n, dtype=torch.float32) for _ in range(2))
        argmax = logits.new_empty(n, dtype=torch.int64)
        g_lp = g_h = best
    else:
        g_lp, g_h, stats = (None if t is None else t.float().contiguous() for t in grad)
        best = argmax = z_y = g_lp
    entropy_grad = grad is not None and g_h is not None
    _linear_logprobs_rows_kernel[(n,)](
        logits, target, inv_t, g_lp, g_h if entropy_grad else g_lp, stats, best, argmax,
        z_y, V, col0, opts.ignore_index, opts.softcap if opts.softcap is not None else 1.0,
        logits.stride(0), HAS_GRAD=grad is not None, HAS_ENTROPY_GRAD=entropy_grad,
        WANT_ENTROPY=entropy, HAS_SOFTCAP=opts.softcap is not None,
        BLOCK_V=_block_v(V), num_warps=8)
    if grad is not None:
        return logits
    return TileStats(*stats.unbind(1), best, argmax, z_y)

"""Triton row kernel for the log-probs: logsumexp, log-prob, entropy, argmax and the
logits gradient of a logits chunk (the math of rows.py, its LogProbRows).

One program per token row. The forward sweeps a row once, forming the logsumexp, the
entropy's sum_c p_c z_c and the argmax online (on a vocabulary tile, it merges the
tile's sums into the running ones, as logprob.merge_tile_stats); the backward,
given the forward's row statistics relative to the row max (rows.py), sweeps it
once more, writing the logits gradient over the recomputed logits in place: each pass
reads a chunk once (and the backward writes it once), in its own dtype. The sampler's
truncation on these kernels is truncation_kernels.py's.
"""

import torch
import triton
import triton.language as tl

from ..rowmath.kernels import (_block_max, _block_v, _load_z, _rebased_ez, _sweep_start,
                               dz_buffer)
from .rows import LogProbRows, shard_stats
from .truncation import ROW_STATS


@triton.jit
def _stats_sweep(row_ptr, V, inv_t, softcap, HAS_SOFTCAP: tl.constexpr,
                 WANT_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """(m, s, ez, best, argmax) of one row of z = softcap(l) * inv_t: the max, s =
    sum_c exp(z_c - m), ez = sum_c exp(z_c - m) (z_c - m) (0 unless WANT_ENTROPY), the
    max of softcap(l) and its first column.

    ez kept online has no 0 * -inf for masked or -inf logits, and no cancellation
    against m for confident rows."""
    cols = tl.arange(0, BLOCK_V)
    m, s, best, best_i = _sweep_start(BLOCK_V)
    ez = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        c = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
        # argmax of softcap(l) (the same class as of z for inv_t > 0), first one on ties;
        # z's max is the block's max times inv_t (rounding keeps order under a positive
        # scale), so one reduction serves both
        bc, best, best_i = _block_max(c, v0, best, best_i, True)
        z = c * inv_t
        m_new = tl.maximum(m, bc * inv_t)
        scale = tl.exp(m - m_new)
        ex = tl.where(mask, tl.exp(z - m_new), 0.0)
        if WANT_ENTROPY:  # ez = sum_c exp(z_c - m) (z_c - m), rebased to the new max
            ez = scale * _rebased_ez(ez, s, m, m_new) + tl.sum(
                tl.where(ex > 0.0, ex * (z - m_new), 0.0), axis=0)
        s = s * scale + tl.sum(ex, axis=0)
        m = m_new
    return m, s, ez, best, best_i


@triton.jit
def _merge(acc_ptr, n, row, m, s, ez, best, z_y):
    """Folds a tile's (m, s, ez, best, z_y) of a row into the running ones at acc_ptr
    (5, n) (as logprob.merge_tile_stats); returns whether the tile's best won."""
    m0 = tl.load(acc_ptr + row)
    s0 = tl.load(acc_ptr + n + row)
    ez0 = tl.load(acc_ptr + 2 * n + row)
    best0 = tl.load(acc_ptr + 3 * n + row)
    mm = tl.maximum(m0, m)
    a = tl.exp(m0 - mm)
    b = tl.exp(m - mm)
    tl.store(acc_ptr + row, mm)
    tl.store(acc_ptr + n + row, a * s0 + b * s)
    tl.store(acc_ptr + 2 * n + row,
             a * _rebased_ez(ez0, s0, m0, mm) + b * _rebased_ez(ez, s, m, mm))
    better = best > best0  # the first most likely class stays on ties; NaN never wins
    tl.store(acc_ptr + 3 * n + row, tl.where(better, best, best0))
    tl.store(acc_ptr + 4 * n + row, tl.load(acc_ptr + 4 * n + row) + z_y)
    return better


@triton.jit
def _linear_logprobs_rows_kernel(
    # pointers
    logits_ptr, dz_ptr, target_ptr, inv_t_ptr, g_lp_ptr, g_h_ptr, stats_ptr,
    logprob_ptr, entropy_ptr, lse_ptr, argmax_ptr, acc_ptr,
    # sizes and options
    n, V, col0, ignore_index, softcap,
    # strides
    stride_ln, stride_dn,
    # meta-parameters
    HAS_GRAD: tl.constexpr, TILE: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    WANT_ENTROPY: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
    TRUNCATED: tl.constexpr = False, STATS_W: tl.constexpr = 3,
):
    """Without HAS_GRAD (the forward) on whole rows: logits (n, V) -> logprob,
    entropy, lse (n,) float32, argmax (n,) int64 and the row statistics (n, 3) (m,
    log s, d). With TILE, the logits are the classes [col0, col0 + V) of a vocabulary
    tile: their statistics are merged into the running ones, acc (5, n) = (m, s, ez,
    best, z_y) and argmax. With HAS_GRAD (the backward): dz (the logits themselves or a
    buffer of the inputs' dtype) <- dl for upstream
    g_lp (and, with HAS_ENTROPY_GRAD, g_h), from the forward's row statistics; the
    logits may be a tile's (col0). TRUNCATED (the backward only): the sampler's kept set
    (truncation.py): row_stats (n, ROW_STATS) also holds its last class (v, c)
    and whether the target is kept; p is q_K, 0 outside it."""
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
        if TILE:
            better = _merge(acc_ptr, n, row, m, s, ez, best, tl.where(here, z_y, 0.0))
            tl.store(argmax_ptr + row,
                     tl.where(better, best_i + col0, tl.load(argmax_ptr + row)))
        else:
            log_s = tl.log(s)
            d = ez / s
            lse = m + log_s
            # Out-of-range targets never read out of bounds: they poison the row with NaN.
            # (z_y - m) - log s: exact near the max (logprob.finish_stats)
            lp = tl.where(here, (z_y - m) - log_s, float("nan"))
            tl.store(logprob_ptr + row, tl.where(valid, lp, 0.0))
            tl.store(lse_ptr + row, lse)
            tl.store(argmax_ptr + row, best_i)
            tl.store(stats_ptr + row * 3, m)
            tl.store(stats_ptr + row * 3 + 1, log_s)
            tl.store(stats_ptr + row * 3 + 2, d)
            if WANT_ENTROPY:
                tl.store(entropy_ptr + row, tl.where(valid, log_s - d, 0.0))
    else:
        W = STATS_W  # row_stats' width
        m = tl.load(stats_ptr + row * W)
        log_s = tl.load(stats_ptr + row * W + 1)
        g = tl.where(valid, tl.load(g_lp_ptr + row), 0.0)
        if TRUNCATED:  # K's last class (v, c); a target outside K has no gradient
            v_last = tl.load(stats_ptr + row * W + 3)
            c_last = tl.load(stats_ptr + row * W + 4)
            g = tl.where(tl.load(stats_ptr + row * W + 5) > 0.0, g, 0.0)
        if HAS_ENTROPY_GRAD:
            h = tl.where(valid, tl.load(g_h_ptr + row), 0.0)
            d = tl.load(stats_ptr + row * W + 2)
        dz_row = dz_ptr + row * stride_dn
        cols = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            mask = offs < V
            c = _load_z(row_ptr + offs, mask, softcap, HAS_SOFTCAP)
            zm = c * inv_t - m  # exact near the max
            p = tl.exp(zm - log_s)
            if TRUNCATED:  # the forward's candidates' z, bit for bit (_gather_z_kernel)
                z = c * inv_t
                j = (offs + col0).to(tl.float32)  # exact below 2^24 classes
                kept = (z > v_last) | ((z == v_last) & (j <= c_last))
                p = tl.where(kept, p, 0.0)
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
            tl.store(dz_row + offs, dz.to(dz_row.dtype.element_ty), mask=mask)


def triton_logprob_stats(logits, target, inv_t, opts, entropy, math_dtype):
    """LogProbRows.stats (rows.py) on the Triton kernel: one sweep per row."""
    assert math_dtype == torch.float32
    return _launch(logits, target, inv_t, opts, entropy, None)[:5]


def triton_logprob_tile_stats(logits, target, inv_t, opts, entropy, math_dtype, col0, into):
    """LogProbRows.tile_stats: the tile's sums merged into `into` (made by
    logprob.empty_tile_stats) in the kernel."""
    assert math_dtype == torch.float32
    _launch(logits, target, inv_t, opts, entropy, None, col0, into)


def triton_logprob_grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype,
                        col0, dz_dtype):
    """LogProbRows.grad: dz written over logits (or into dz_buffer's), returned."""
    assert math_dtype == torch.float32
    return _launch(logits, target, inv_t, opts, False, (g_lp, g_h, row_stats), col0,
                   dz=dz_buffer(logits, dz_dtype))[5]


def triton_logprob_stats_then_grad(logits, target, inv_t, opts, upstream, math_dtype, shard,
                                   dz_dtype):
    """LogProbRows.stats_then_grad: a forward sweep, the upstream gradients, a gradient
    sweep over the same chunk (a shard's sums are merged into a fresh TileStats and
    made global between the two)."""
    outputs = shard_stats(TRITON_LOGPROB_ROWS, logits, target, inv_t, opts, True,
                          math_dtype, shard)
    g_lp, g_h = upstream(outputs[0], outputs[1])
    return (*outputs, triton_logprob_grad(logits, target, inv_t, opts, g_lp, g_h,
                                          outputs[4], math_dtype, shard.vocab_start,
                                          dz_dtype))


def _launch(logits, target, inv_t, opts, entropy, grad, col0=None, into=None, dz=None,
            truncated=False):
    """One launch of the kernel: the forward sweep (of whole rows with col0 None, or of
    the classes [col0, col0 + V) merged into `into`), or the gradient sweep for grad =
    (g_lp, g_h, row_stats) into dz."""
    n, V = logits.shape
    assert logits.stride(1) == 1
    # Unit-stride indexing in the kernel: views (an expanded temperature) are copied.
    target, inv_t = target.contiguous(), inv_t.float().contiguous()
    tile = grad is None and col0 is not None
    acc = argmax = None
    if grad is not None:
        g_lp, g_h, stats = (None if t is None else t.float().contiguous() for t in grad)
        logprob = ent = lse = g_lp
    elif tile:
        # The running statistics' float fields are the rows of one (5, n) buffer.
        acc = into.m.as_strided((5, n), (n, 1))
        assert acc.dtype == torch.float32 and into.z_y.data_ptr() == acc[4].data_ptr()
        argmax = into.argmax
        logprob = ent = lse = g_lp = g_h = stats = acc
    else:
        logprob, ent, lse = (logits.new_empty(n, dtype=torch.float32) for _ in range(3))
        argmax = logits.new_empty(n, dtype=torch.int64)
        stats = logits.new_empty(n, 3, dtype=torch.float32)
        g_lp = g_h = lse
    entropy_grad = grad is not None and g_h is not None
    dz = logits if dz is None else dz
    _linear_logprobs_rows_kernel[(n,)](
        logits, dz, target, inv_t, g_lp, g_h if entropy_grad else g_lp, stats, logprob, ent,
        lse, argmax if argmax is not None else g_lp, acc if acc is not None else g_lp,
        n, V, 0 if col0 is None else col0, opts.ignore_index,
        opts.softcap if opts.softcap is not None else 1.0,
        logits.stride(0), dz.stride(0), HAS_GRAD=grad is not None, TILE=tile,
        HAS_ENTROPY_GRAD=entropy_grad, WANT_ENTROPY=entropy,
        HAS_SOFTCAP=opts.softcap is not None, BLOCK_V=_block_v(V), TRUNCATED=truncated,
        STATS_W=ROW_STATS if truncated else 3, num_warps=8)
    if grad is not None:
        return None, None, None, None, None, dz
    if tile:
        return None
    return logprob, ent, lse, argmax, stats, None


TRITON_LOGPROB_ROWS = LogProbRows(triton_logprob_stats, triton_logprob_tile_stats,
                                  triton_logprob_grad, triton_logprob_stats_then_grad)

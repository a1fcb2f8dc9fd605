"""Triton twin of sparse_rows.sparse_rows: a loss over a few classes of each row swept
twice. The first sweep forms a row's logsumexp at T (and, for the sparse divergence,
the entropy); the loss terms and their derivative g on the support follow from the
gathered support logits (in PyTorch between the two kernels); the second sweep writes
dz's softmax part, -sum(g) q / T; the support classes' exact values (that plus their
g / T) are then written over theirs, each rounded once."""

import torch
import triton
import triton.language as tl

from ..loop.chunked import ONE_DEVICE
from .common import RowMath, all_reduce_sums, capped
from .kernels import _block_v, _load_a, _online, _start, dz_over
from .sparse_rows import class_sums, scatter_whole

_WARPS = 8  # the launch's warps (torch_fce/bench/probes/distill_profile.py measures others)


@triton.jit
def _online_xlx(m, s, t, u):
    """_online's (m, s) and t = sum exp(u - m) (u - m) after block u (t rescaled as the
    max moves: t' = r (t + (m - m') s), r = exp(m - m'))."""
    m_new = tl.maximum(m, tl.max(u, axis=0))
    r = tl.exp(m - m_new)
    x = u - m_new
    e = tl.exp(x)
    t = r * (t + (m - m_new) * s) + tl.sum(tl.where(e > 0.0, e * x, 0.0), axis=0)
    return m_new, s * r + tl.sum(e, axis=0), t


@triton.jit
def _row_sums(z_row, V, inv_t, scale, cap, HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """(m, s, t) of a logits row: u = softcap(scale z) / T, s = sum e, e = exp(u - m)
    (lse = m + log s) and with ENTROPY t = sum e (u - m) (_online_xlx; the entropy -sum
    q log q = log s - t / s), else 0."""
    cols = tl.arange(0, BLOCK_V)
    m, s = _start(BLOCK_V)
    t = s
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        u = _load_a(z_row + offs, offs < V, scale, cap, HAS_CAP) * inv_t
        if ENTROPY:
            m, s, t = _online_xlx(m, s, t, u)
        else:
            m, s = _online(m, s, u)
    return m, s, t


@triton.jit
def _sparse_stats_kernel(z_ptr, inv_t_ptr, out_ptr, n, V, stride_z, scale, cap,
                         HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Logits rows (n, V) -> out (2, n): m, s (_row_sums)."""
    row = tl.program_id(0).to(tl.int64)
    m, s, _ = _row_sums(z_ptr + row * stride_z, V, tl.load(inv_t_ptr + row), scale, cap,
                        HAS_CAP, False, BLOCK_V)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + n + row, s)


@triton.jit
def _softmax_sweep(z_row, dz_row, V, inv_t, m, ls, c, scale, cap, HAS_CAP: tl.constexpr,
                   OVER: tl.constexpr, BLOCK_V: tl.constexpr):
    """Writes dz = c softmax(u) d a / d z / scale over a logits row, c the row's
    coefficient (exactly 0 where c is). OVER: dz of half the logits' width over their
    row's first half (ce.dz_over): block b's stores land on classes of blocks <= b, so
    every warp's loads of the block come before any warp's stores."""
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        a = _load_a(z_row + offs, mask, scale, cap, HAS_CAP)
        if OVER:
            tl.debug_barrier()
        d = tl.exp((a * inv_t - m) - ls) * c
        if HAS_CAP:
            th = a / cap
            d *= 1.0 - th * th
        d = tl.where(c != 0.0, d, 0.0)
        tl.store(dz_row + offs, d.to(dz_row.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_grad_kernel(z_ptr, dz_ptr, inv_t_ptr, m_ptr, ls_ptr, coef_ptr, V, stride_z,
                        stride_d, scale, cap, HAS_CAP: tl.constexpr, OVER: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    """_softmax_sweep over logits rows (n, V), c (n,) the row's coefficient -sum(g)
    scale / T; the support classes' values are written over these afterwards."""
    row = tl.program_id(0).to(tl.int64)
    _softmax_sweep(z_ptr + row * stride_z, dz_ptr + row * stride_d, V,
                   tl.load(inv_t_ptr + row), tl.load(m_ptr + row), tl.load(ls_ptr + row),
                   tl.load(coef_ptr + row), scale, cap, HAS_CAP, OVER, BLOCK_V)


def triton_sparse_rows(z, idx, inv_t, terms, mdt, dz_dtype, want_grad, logit_scale=1.0,
                       softcap=None, shard=ONE_DEVICE):
    """sparse_rows.sparse_rows on the Triton kernels: a sweep for each row's logsumexp, terms
    on the support's log-probs (from its gathered logits), a sweep writing the softmax
    part of dz, then the support classes' exact values over theirs (each rounded once);
    a row whose g is all 0 exactly 0, as sparse_rows'. A vocabulary shard's z holds its
    classes: the sweeps' sums and each support class's logit (from the shard holding
    it) are all-reduced before terms (common.all_reduce_sums), and dz is its own
    classes'."""
    n, V = z.shape
    assert mdt == torch.float32 and z.stride(1) == 1
    inv_t = inv_t.float().contiguous()
    sharded, col = shard.group is not None, idx
    if sharded:  # each support class's column in this shard
        col = idx - shard.vocab_start
        here = (col >= 0) & (col < V)
        col = torch.where(here, col, 0)
    # the support's a = softcap(scale z), gathered before dz may be written over z
    a_k, da_k = capped(z.gather(1, col), logit_scale, softcap, mdt)
    u_k = a_k * inv_t[:, None]
    sums = z.new_empty((2, n), dtype=torch.float32)
    flags = dict(HAS_CAP=softcap is not None, BLOCK_V=_block_v(V), num_warps=_WARPS)
    scale, cap = float(logit_scale), float(softcap or 1.0)
    _sparse_stats_kernel[(n,)](z, inv_t, sums, n, V, z.stride(0), scale, cap, **flags)
    m, s = sums
    if sharded:
        m, s, _, *u_k = all_reduce_sums(m, s, torch.zeros_like(s), shard,
                                        *torch.where(here, u_k, 0.0).T)
        u_k = torch.stack(u_k, 1)
    ls = s.log()
    log_q = (u_k - m[:, None]) - ls[:, None]  # relative to the max
    loss_t, g, *stats = terms(log_q)
    if not want_grad:
        return (loss_t, *stats), None
    c = inv_t[:, None] * logit_scale  # d u / d (logit_scale z), times logit_scale
    coef = (-g.sum(-1, keepdim=True) * c).contiguous()
    dz = dz_over(z, dz_dtype)
    _sparse_grad_kernel[(n,)](z, dz, inv_t, m, ls, coef, V, z.stride(0), dz.stride(0),
                              scale, cap, OVER=dz.dtype != z.dtype, **flags)
    exact = coef * log_q.exp() + c * class_sums(idx, g)
    if da_k is not None:  # softcap'(.): da is d a / d z, the scale included
        exact = exact * (da_k / logit_scale)
    # a row whose g is all 0: exactly 0 (the kernel wrote its other classes so)
    exact = torch.where((g == 0).all(-1, keepdim=True), 0.0, exact)
    if not sharded:
        return (loss_t, *stats), dz.scatter_(1, idx, exact.to(dz.dtype))
    scatter_whole(dz, col, here, exact.to(dz.dtype))
    return (loss_t, *stats), dz


ROWS = RowMath(triton_sparse_rows, temporaries=0, dz_over=True)

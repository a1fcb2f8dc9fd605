"""Triton pieces of the sparse divergence's row kernels (kernels.py): the entry formula
(_jsd_entry, TRL's _jsd_divergence and its derivative), the support's reads, and a row's
sums over the vocabulary, swept in the row kernel on one device (_marked_sums,
_row_sums) or, on a vocabulary shard, by _sparse_sums_kernel in a launch of its own
(its sums all-reduced before the row kernel reads them, _load_part)."""

import triton
import triton.language as tl

from ..rowmath.kernels import _load_a, _start, _tanh
from ..rowmath.sparse_rows_kernels import _online_xlx, _row_sums


_TAIL_MAX = tl.constexpr(-1e-7)  # TRL's clamp of the support's log-mass (the tail bucket)


_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's tiny: the mixture's log clamp


_FMAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _expm1(x):
    """exp(x) - 1 without exp's cancellation near 0: the Taylor series below |x| = 0.3
    (exact to float32 rounding there)."""
    small = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (
        1.0 / 720.0 + x * (1.0 / 5040.0 + x / 40320.0)))))))
    return tl.where(tl.abs(x) < 0.3, small, tl.exp(x) - 1.0)


@triton.jit
def _masked_lse(x, mask):
    """torch.logsumexp of x's entries under mask: -inf over none, NaN if one is NaN."""
    mx = tl.max(tl.where(mask, x, float("-inf")), axis=0)
    mx = tl.where(tl.abs(mx) == float("inf"), 0.0, mx)
    return mx + tl.log(tl.sum(tl.where(mask, tl.exp(x - mx), 0.0), axis=0))


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def _nan_to_num(x):
    """torch.nan_to_num(x, nan=0.0): NaN 0, +-inf float32's largest."""
    return tl.where(x == x, tl.minimum(tl.maximum(x, -_FMAX), _FMAX), 0.0)


@triton.jit
def _log1p(x):
    """log(1 + x) to float32 rounding (log(u) x / (u - 1), u = 1 + x: the rounding of u
    cancels)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


@triton.jit
def _multiplicity(support_ptr, teacher_ptr, row, K, V, ignore_index, safe,
                  BLOCK_K: tl.constexpr, SUB_K: tl.constexpr):
    """(BLOCK_K,) float32: how many valid entries of the row name each entry's class."""
    mult = tl.zeros([BLOCK_K], tl.float32)
    for j0 in range(0, BLOCK_K, SUB_K):
        jj = j0 + tl.arange(0, SUB_K)
        entries_j, bad_j, safe_j, _ = _support_block(support_ptr, teacher_ptr, row, K, jj,
                                                     V, ignore_index)
        same = (safe[:, None] == safe_j[None, :]) & (entries_j & ~bad_j)[None, :]
        mult += tl.sum(same.to(tl.float32), axis=1)
    return mult


@triton.jit
def _rest_sums(z_row, V, inv_t, scale, cap, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """(m, s, t, count) of a row's classes whose logit is not -inf: u = softcap(scale z)
    / T, s = sum exp(u - m), t = sum exp(u - m) (u - m) (_row_sums'), and how many
    logits are -inf."""
    cols = tl.arange(0, BLOCK_V)
    m, s = _start(BLOCK_V)
    t = s
    count = tl.sum(tl.zeros([BLOCK_V], tl.int32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        raw = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
        keep = mask & (raw != float("-inf"))
        count += BLOCK_V - tl.sum(keep.to(tl.int32), axis=0) - tl.maximum(v0 + BLOCK_V - V, 0)
        a = raw * scale
        if HAS_CAP:
            a = cap * _tanh(a / cap)
        m, s, t = _online_xlx(m, s, t, tl.where(keep, a, float("-inf")) * inv_t)
    return m, s, t, count


@triton.jit
def _jsd_entry(sh, th, beta, one_m_beta, KIND: tl.constexpr):
    """(term, d term / d sh) of rows._jsd at entries (or the tail bucket) of the
    student's and teacher's log-probs sh, th, with the derivative autograd forms
    (nan_to_num's: 0 where its argument is not finite; the clamp's: 0 below tiny)."""
    q = tl.exp(sh)
    p = tl.exp(th)
    if KIND == 0:
        x = p * (th - sh)
        return _nan_to_num(x), tl.where(_finite(x), -p, 0.0)
    elif KIND == 1:
        x = q * (sh - th)
        return _nan_to_num(x), tl.where(_finite(x), x + q, 0.0)
    else:
        mix = one_m_beta * q + beta * p
        mc = tl.where(mix < _TINY, _TINY, mix)  # clamp_min's: NaN stays NaN
        lm = tl.log(mc)
        dlm = tl.where(mix >= _TINY, one_m_beta * q / mc, 0.0)  # d log m / d sh
        xa = p * (th - lm)
        xb = q * (sh - lm)
        term = beta * _nan_to_num(xa) + one_m_beta * _nan_to_num(xb)
        d = beta * tl.where(_finite(xa), -p * dlm, 0.0) + \
            one_m_beta * tl.where(_finite(xb), xb + q - q * dlm, 0.0)
        return term, d


@triton.jit
def _support_block(support_ptr, teacher_ptr, row, K, ks, V, ignore_index):
    """(entries, bad, safe, teacher) of a row's support entries ks: the valid ones
    (rows.sparse_entries), the valid ones outside [0, V), the classes safe to read
    (0 for both others) and the teacher's log-probs in float32."""
    kmask = ks < K
    sup = tl.load(support_ptr + row * K + ks, mask=kmask, other=0).to(tl.int64)
    tch = tl.load(teacher_ptr + row * K + ks, mask=kmask, other=float("-inf")).to(tl.float32)
    entries = kmask & (sup != ignore_index) & (tch > float("-inf"))
    bad = entries & ((sup < 0) | (sup >= V))
    return entries, bad, tl.where(entries & ~bad, sup, 0), tch


@triton.jit
def _local(safe, ks, K, start, V):
    """(here, col) of a row's support entries ks of classes safe: those among this
    shard's classes [start, start + V) and their columns (0 elsewhere; on one device
    every entry, at safe itself)."""
    col = safe - start
    here = (ks < K) & (col >= 0) & (col < V)
    return here, tl.where(here, col, 0)


@triton.jit
def _gather_here(z_row, g_row, support_ptr, teacher_ptr, row, K, ks, V, V_all, start,
                 ignore_index, scale, cap, HAS_CAP: tl.constexpr):
    """Stores the row's support logits a = softcap(scale z) held here to its scratch (0
    for the others'); returns (entries, bad, here, col)."""
    entries, bad, safe, _ = _support_block(support_ptr, teacher_ptr, row, K, ks, V_all,
                                           ignore_index)
    here, col = _local(safe, ks, K, start, V)
    tl.store(g_row + ks, tl.where(here, _load_a(z_row + col, here, scale, cap, HAS_CAP),
                                  0.0))
    return entries, bad, here, col


@triton.jit
def _marked_sums(z_row, g_row, support_ptr, teacher_ptr, row, K, ks, V, V_all, start,
                 ignore_index, inv_t, scale, cap, HAS_CAP: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """_rest_sums of a row without its support's classes: the student's mass off the
    support summed directly (1 - its sum on the support cancels when the support holds
    nearly all of it). The support's logits wait in the scratch (_gather_here), set to
    -inf for the sweep, which leaves -inf logits out and counts them."""
    entries, bad, here, col = _gather_here(z_row, g_row, support_ptr, teacher_ptr, row, K,
                                           ks, V, V_all, start, ignore_index, scale, cap,
                                           HAS_CAP)
    tl.debug_barrier()  # every warp's gathers before any mark (duplicate classes)
    tl.store(z_row + col, tl.full(ks.shape, float("-inf"), tl.float32)
             .to(z_row.dtype.element_ty), mask=entries & ~bad & here)
    tl.debug_barrier()  # the marks before any warp's loads
    return _rest_sums(z_row, V, inv_t, scale, cap, HAS_CAP, BLOCK_V)


@triton.jit
def _store_part(part_ptr, n, row, m, s, t, count):
    tl.store(part_ptr + row, m)
    tl.store(part_ptr + n + row, s)
    tl.store(part_ptr + 2 * n + row, t)
    tl.store(part_ptr + 3 * n + row, count)


@triton.jit
def _load_part(part_ptr, n, row):
    return (tl.load(part_ptr + row), tl.load(part_ptr + n + row),
            tl.load(part_ptr + 2 * n + row), tl.load(part_ptr + 3 * n + row))


@triton.jit
def _sparse_sums_kernel(z_ptr, support_ptr, teacher_ptr, inv_t_ptr, g_ptr, part_ptr, n, V,
                        V_all, start, K, ignore_index, scale, cap, stride_z,
                        TAIL: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """A vocabulary shard's sweep of _sparse_divergence_kernel: its sums (m, s, t and the
    -inf logits counted, _marked_sums' with the tail, else _row_sums') to part (4, n),
    its support's logits to the scratch g (n, BLOCK_K), for the caller to all-reduce."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31
    z_row = z_ptr + row * stride_z
    g_row = g_ptr + row * BLOCK_K
    ks = tl.arange(0, BLOCK_K)
    inv_t = tl.load(inv_t_ptr + row)
    if TAIL:
        m, s, t, count = _marked_sums(z_row, g_row, support_ptr, teacher_ptr, row, K, ks, V,
                                      V_all, start, ignore_index, inv_t, scale, cap, HAS_CAP,
                                      BLOCK_V)
        count = count.to(tl.float32)
    else:
        m, s, t = _row_sums(z_row, V, inv_t, scale, cap, HAS_CAP, True, BLOCK_V)
        count = 0.0
        _gather_here(z_row, g_row, support_ptr, teacher_ptr, row, K, ks, V, V_all, start,
                     ignore_index, scale, cap, HAS_CAP)
    _store_part(part_ptr, n, row, m, s, t, count)

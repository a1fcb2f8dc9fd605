"""Triton primitives every op's row kernels share: float32's lowest as a running max,
tanh for the softcap, the logits' loads with their transform, the online max and
sums, where a kernel writes dz, float32's order-preserving int32 images, the normal
law's distribution function and its inverse, and the exp-GEMM pipeline's exact powers of
two and the strips its gradient GEMMs read (loop/exp_gemms.py)."""

import torch
import triton
import triton.language as tl


# float32's lowest, a finite "minus infinity" for running maxima: m_old - m_new stays a
# number for rows that are -inf so far, and no finite logit is below it.
_NEG_BIG = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _tanh(x):
    # tanh from exp loses relative accuracy near 0 (1 - 2/(e^2x + 1) cancels), so small
    # arguments use the Taylor series, exact to float32 rounding below |x| = 0.3.
    ax = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (
        62.0 / 2835.0 + x2 * (-1382.0 / 155925.0))))))
    return tl.where(ax < 0.3, small, tl.where(x < 0.0, -big, big))


@triton.jit
def _load_z(ptrs, mask, softcap, HAS_SOFTCAP: tl.constexpr):
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return tl.where(mask, z, float("-inf"))


@triton.jit
def _block_max(z, v0, best, best_i, WANT_ARGMAX: tl.constexpr):
    """(max, best, best_i) of a block z of columns starting at v0: its max and, with
    WANT_ARGMAX, the first maximum so far and its column (a NaN never wins). The
    column's reduction, the costly one, runs only for a block that may hold a new
    maximum: after a row's first few blocks, rarely."""
    bz = tl.max(z, axis=0)
    if WANT_ARGMAX:
        if (bz > best) | (bz != bz):  # a NaN max (where the reduction keeps NaN) too
            bv, bi = tl.max(tl.where(z == z, z, float("-inf")), axis=0, return_indices=True,
                            return_indices_tie_break_left=True)
            better = bv > best
            best_i = tl.where(better, v0 + bi.to(tl.int64), best_i)
            best = tl.where(better, bv, best)
    return bz, best, best_i


@triton.jit
def _sweep_start(BLOCK_V: tl.constexpr):
    """An online sweep's starting state, as scalars: the running max, the sum of exp,
    the best logit (for the argmax) and its column."""
    m = tl.max(tl.full([BLOCK_V], _NEG_BIG, tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    best = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    best_i = tl.sum(tl.zeros([BLOCK_V], tl.int64), axis=0)
    return m, s, best, best_i


@triton.jit
def _rebased_ez(ez, s, m, m_new):
    """ez relative to a larger max m_new, before the exp(m - m_new) scale: 0 for no
    classes (s = 0), where m - m_new may overflow to -inf (common.rebased_ez)."""
    return tl.where(s > 0.0, ez + (m - m_new) * s, 0.0)


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


def _block_v(V):
    return min(4096, triton.next_power_of_2(V))


def dz_buffer(logits, dz_dtype):
    """Where a row kernel writes dz: over the logits in their own dtype, else (float32
    logits of low-precision inputs) into a buffer of dz_dtype."""
    return logits if logits.dtype == dz_dtype else torch.empty_like(logits, dtype=dz_dtype)


def dz_over(logits, dz_dtype):
    """dz written over the logits also where they are wider (float32 logits, a 16-bit
    dz): the first half of each row's bytes, a (n, V) view of row stride 2V, which
    cuBLAS reads as it is. For kernels whose dz sweep stores only over classes every
    warp has read (a barrier between a block's loads and its stores, _softmax_sweep's
    OVER) and read nothing of the row after it."""
    if logits.dtype == dz_dtype:
        return logits
    assert logits.stride(1) == 1 and logits.dtype.itemsize == 2 * dz_dtype.itemsize
    return logits.view(dz_dtype)[:, :logits.shape[1]]


@triton.jit
def _key(x):
    """The order-preserving int32 image of float32 x (not NaN): a negative float's
    magnitude bits flipped. -0.0 and +0.0 get distinct images (the callers that need
    them equal pass +0.0)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _unkey(key):
    """The float32 of an int32 image (the flip is its own inverse)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _image(x):
    """The order-preserving int32 image of float32 x (not NaN), -0.0 and +0.0 as one:
    adjacent floats have adjacent images."""
    k = _key(x)
    return tl.where(k < 0, k + 1, k)


@triton.jit
def _from_image(k):
    return _unkey(tl.where(k < 0, k - 1, k))


@triton.jit
def _below(x):
    """The largest float32 below x (not NaN, > -inf): classes > _below(x) are those >= x."""
    return _from_image(_image(x) - 1)


@triton.jit
def _phi(x):
    """The standard normal law's distribution function."""
    return 0.5 + 0.5 * tl.erf(x * 0.7071067811865476)


@triton.jit
def _phi_inv(u):
    """Its inverse on (0, 1), to 4.5e-4 (Abramowitz and Stegun 26.2.23)."""
    q = tl.maximum(tl.minimum(u, 1.0 - u), 1e-30)
    t = tl.sqrt(-2.0 * tl.log(q))
    x = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (
        1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(u < 0.5, -x, x)


@triton.jit
def _pow2(d):
    """exp_gemms.merged's 2^d of an integral float32 d <= 0 from its bits: exact (the
    GPU's ex2.approx is not), 0 below 2^-126, NaN for NaN."""
    normal = ((tl.where(d >= -126.0, d, 0.0).to(tl.int32) + 127) << 23).to(tl.float32,
                                                                           bitcast=True)
    return tl.where(d >= -126.0, normal, tl.where(d == d, 0.0, d))


@triton.jit
def _store_strips(k_ptr, u_ptr, uv_ptr, rows, live, k_r, v, M, T,
                  REP: tl.constexpr, BLOCK_T: tl.constexpr):
    """An ExpGrad's strips of a block of rows (live: rows < M) of k (M, T): u = 2^(k -
    k_r) and bf16(u v), entry (t REP + j, row) for each n-tile t (exp_gemms.strips)."""
    ts = tl.arange(0, BLOCK_T)
    base = rows.to(tl.int64)[:, None] * T
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + ts
        mask = live[:, None] & (tt < T)[None, :]
        k = tl.load(k_ptr + base + tt[None, :], mask=mask, other=0.0)
        u = _pow2(k - k_r[:, None])
        uv = (u * v[:, None]).to(tl.bfloat16)
        at = (tt.to(tl.int64) * REP)[None, :] * M + rows[:, None]
        for j in tl.static_range(REP):
            tl.store(u_ptr + at + j * M, u.to(tl.bfloat16), mask=mask)
            tl.store(uv_ptr + at + j * M, uv, mask=mask)

"""Triton row kernel: the exact per-row top-k of a logits chunk's log-softmax, the twin
of rows.py's topk_rows (its tie rule: value descending, equal values by
ascending class).

One program per token row, one streaming sweep over the vocabulary and a few gathers in
the common case (no reduction across warps or scan inside the sweep: on the H200 a sweep
with a block-wide scan per block holding candidates cost 2.3-6.6x a read, k 8-128), in a
kernel of their own (_candidates_kernel):
  sweep    the logsumexp online per lane, the lanewise maxima of the row's blocks,
           folded into G groups (group j: the classes = j mod G), and each 32-class
           segment's maximum, written to the row's segment scratch. The k-th largest
           group maximum t is a lower bound of the k-th largest value v_k: the k groups
           of largest maxima hold k distinct classes >= t.
  listing  the segments whose maximum is >= t (no more than the classes >= t: about
           1.15 k for G = 4k), their indices to a list (scans of 1024 maxima).
  gathers  when they fit in the row scratch's C slots (the common case), the listed
           segments' classes read again, 32 segments a step, and each one >= t written
           as its sort key (value, then class). A row is read once, and then about
           1.15 k segments of 32 classes, not twice more (the three-sweep kernel before:
           docs/distillation.md).
A second kernel (_topk_rows_kernel) ranks the candidates among each other by key
(keys are distinct: rank r < k is the r-th of the top-k, in the tie rule). Otherwise
(many ties at t, such as a padding row's, or structured rows whose largest values
share few groups) it first runs an ordered compaction, the classes above a threshold
x and the first k equal to it (in class order), and a bisection over the values'
order-preserving int32 images re-sweeps the row at new thresholds until they fit: it
keeps count(u >= lo) >= k > count(u > hi), and at lo = hi = v_k the classes above
v_k (< k) and k of its ties fit in C >= 2k - 1 slots. So a row takes at most 37
sweeps (the interval of images halves), whatever its values.

Selection ranks NaN as -inf (NaN never compares, and the bisection needs a total
order); the row's lse, and so every log-prob of a row holding a NaN, is NaN. An
out-of-range target (not ignore_index) gives a NaN target log-prob.

A vocabulary shard runs the same two kernels on its classes, the ranking writing the
values of its k candidates (its (m, log s) zeroed in between); the shards' (m, log s)
and the target's value (from the shard holding it) are all-reduced and the candidates
merged as topk.py's rows merge theirs, so every rank returns what one device does.
"""

import math

import torch
import triton
import triton.language as tl

from ..loop.chunked import ONE_DEVICE
from ..rowmath.common import all_reduce_sums
from ..rowmath.kernels import _NEG_BIG, _block_v, _key, _load_a, _unkey
from .rows import merged

_WARPS = (4, 8)  # (candidates, ranking) kernels' warps
_BLOCK = 2048  # the sweep's classes a step
_STAGES = 3  # the sweep's loads in flight (tl.range's software pipeline)
_SEGMENT = 32  # classes a segment: the sweep writes each one's maximum (1/32 of a float32 row)
_STEP = 1024  # the segment maxima a listing step reads, the classes a gather step reads
_RANKED = 4096  # the ranking's candidates x slots a step: 16 int64 compares a thread
_EMPTY = tl.constexpr(-9223372036854775808)  # int64's lowest: an empty slot's sort key


@triton.jit
def _ranked(u):
    """Selection's value of u: NaN as -inf."""
    return tl.where(u == u, u, float("-inf"))


@triton.jit
def _sort_key(r, offs):
    """The int64 sort key of classes offs of selection values r: image(r) << 32 |
    (2^31 - 1 - class), larger for a larger value, then for a lower class (+0.0 for
    -0.0: equal values tie)."""
    return (_key(tl.where(r == 0.0, 0.0, r)).to(tl.int64) << 32) \
        | (0x7FFFFFFF - offs).to(tl.int64)


@triton.jit
def _slot(j, n_gt, C: tl.constexpr):
    """The scratch slot of candidate j: the classes above the threshold fill slots
    from 0 up, the ties (the ordered compaction's) from C - 1 down."""
    return tl.where(j < n_gt, j, C - 1 - (j - n_gt))


@triton.jit
def _ranked_block(z_row, offs, V, x, scale, inv_t, cap, HAS_CAP: tl.constexpr):
    """(r, above, tied) of a block of classes offs: their selection values and whether
    each is above x or equal to it (False past V)."""
    mask = offs < V
    r = _ranked(_load_a(z_row + offs, mask, scale, cap, HAS_CAP) * inv_t)
    return r, mask & (r > x), mask & (r == x)


@triton.jit
def _compact(z_row, buf, V, x, k, scale, inv_t, cap, HAS_CAP: tl.constexpr,
             BLOCK_V: tl.constexpr, SUB: tl.constexpr, C: tl.constexpr):
    """(#(u > x), #(u == x)) of a row; the classes above x written to buf's slots from 0
    up, the first k equal to x (by class) from C - 1 down, each as its sort key. Slots
    that would pass the other end are dropped: the caller checks the counts.

    A block only counts; one holding candidates is read again (from L1) in SUB-class
    pieces that write them: the scan and the scattered stores of a whole block take
    the kernel to 213 registers a thread on sm_90 (triton 3.6: one program an SM),
    the pieces to 105-128."""
    cols = tl.arange(0, BLOCK_V)
    sub = tl.arange(0, SUB)
    n_gt = tl.sum(tl.zeros([BLOCK_V], tl.int32), axis=0)
    n_eq = n_gt
    for v0 in range(0, V, BLOCK_V):
        _, above, tied = _ranked_block(z_row, v0 + cols, V, x, scale, inv_t, cap, HAS_CAP)
        if tl.sum((above | tied).to(tl.int32), axis=0) > 0:
            for w0 in range(v0, v0 + BLOCK_V, SUB):
                offs = w0 + sub
                r, gt, eq = _ranked_block(z_row, offs, V, x, scale, inv_t, cap, HAS_CAP)
                # one scan ranks both kinds: above x in the low 16 bits (SUB < 2^16),
                # ties above them
                flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
                before = tl.cumsum(flags, axis=0) - flags
                pos_gt = n_gt + (before & 0xFFFF)
                pos_eq = n_eq + (before >> 16)
                tl.store(buf + tl.where(gt, pos_gt, C - 1 - pos_eq), _sort_key(r, offs),
                         mask=(gt & (pos_gt < C)) | (eq & (pos_eq < k)))
                tot = tl.sum(flags, axis=0)
                n_gt += tot & 0xFFFF
                n_eq += tot >> 16
    return n_gt, n_eq


@triton.jit
def _candidates_kernel(
    # pointers
    z_ptr, inv_t_ptr, buf_ptr, seg_ptr, hit_ptr, stats_ptr, count_ptr,
    # sizes and options
    V, k, scale, cap,
    # strides
    stride_z,
    # meta-parameters
    HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
    C: tl.constexpr, S: tl.constexpr, STEP: tl.constexpr, STAGES: tl.constexpr,
):
    """The sweep and the gathers of logits rows (n, V): each row's (m, log s, t, max) to
    stats (n, 4) float32, the count of classes at or above t to count (n,) int32, and
    when it is at most C their sort keys to the row's scratch buf (n, C) int64. seg
    (n, cdiv(V, S)) float32 the row's segment maxima, hit (n, C) int32 the segments
    holding a class >= t. K the power of two >= k the bitonic top-K of the group maxima
    keeps; STEP the segments (and classes) a gather step takes. A kernel of its own: the
    ranking's and the compaction's registers would leave the sweep fewer warps an SM."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31
    z_row = z_ptr + row * stride_z
    n_seg = tl.cdiv(V, S)
    seg_row = seg_ptr + row * n_seg
    hit_row = hit_ptr + row * C
    SEGS: tl.constexpr = BLOCK_V // S
    segs = tl.arange(0, SEGS)
    cols = segs[:, None] * S + tl.arange(0, S)[None, :]  # a block as (segment, class)
    inv_t = tl.load(inv_t_ptr + row)

    # the sweep: the lse of u = softcap(scale z) / T, online per segment position (no
    # reduction across warps in the loop) and merged after, the lanewise maxima (for the
    # bound) and the segments' maxima (for the gathers); NaN ranks as -inf, and its exp
    # makes the sum (so the lse) NaN
    m = tl.full([SEGS], _NEG_BIG, tl.float32)  # finite: m - m_new stays a number
    s = tl.zeros([SEGS], tl.float32)
    lane = tl.full([SEGS, S], float("-inf"), tl.float32)
    for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        offs = v0 + cols
        u = _load_a(z_row + offs, offs < V, scale, cap, HAS_CAP) * inv_t
        r = _ranked(u)
        seg_max = tl.max(r, axis=1)
        m_new = tl.maximum(m, seg_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(u - m_new[:, None]), axis=1)
        m = m_new
        lane = tl.maximum(lane, r)
        tl.store(seg_row + v0 // S + segs, seg_max, mask=v0 // S + segs < n_seg)
    m_row = tl.max(m, axis=0)
    s = tl.sum(s * tl.exp(m - m_row), axis=0)
    m = m_row
    # the k-th largest of the G group maxima (G >= k; lanes past V are -inf, a bound too)
    group = tl.max(tl.reshape(lane, [BLOCK_V // G, G]), axis=0)
    top = tl.arange(0, K)
    t = tl.max(tl.where(top == k - 1, tl.topk(group, K), float("-inf")), axis=0)

    # the segments whose maximum is at or above t, listed (no more of them than classes
    # >= t: when they pass C, so do the classes); their maxima are other threads' stores
    # (the reductions above synchronise the warps too, but not by contract)
    tl.debug_barrier()
    step = tl.arange(0, STEP)
    n_hit = tl.sum(tl.zeros([STEP], tl.int32), axis=0)
    for j0 in range(0, n_seg, STEP):
        j = j0 + step
        hit = (j < n_seg) & (tl.load(seg_row + j, mask=j < n_seg, other=0.0) >= t)
        pos = n_hit + tl.cumsum(hit.to(tl.int32), axis=0) - hit.to(tl.int32)
        tl.store(hit_row + pos, j, mask=hit & (pos < C))
        n_hit += tl.sum(hit.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list's stores before its loads

    # their classes at or above t, gathered STEP at a time: each one's sort key (value,
    # then class) to the row's slots
    n = n_hit  # more than C: the ranking kernel's compaction takes the row
    if n_hit <= C:
        n = n_hit * 0
        PER: tl.constexpr = STEP // S
        for i0 in range(0, n_hit, PER):
            i = i0 + step // S
            seg = tl.load(hit_row + i, mask=i < n_hit, other=0)
            offs = seg * S + step % S
            mask = (i < n_hit) & (offs < V)
            r = _ranked(_load_a(z_row + offs, mask, scale, cap, HAS_CAP) * inv_t)
            take = (mask & (r >= t)).to(tl.int32)
            pos = n + tl.cumsum(take, axis=0) - take
            tl.store(buf_ptr + row * C + pos, _sort_key(r, offs), mask=(take > 0) & (pos < C))
            n += tl.sum(take, axis=0)
    tl.store(stats_ptr + 4 * row, m)
    tl.store(stats_ptr + 4 * row + 1, tl.log(s))
    tl.store(stats_ptr + 4 * row + 2, t)
    tl.store(stats_ptr + 4 * row + 3, tl.max(group, axis=0))
    tl.store(count_ptr + row, n)


@triton.jit
def _topk_rows_kernel(
    # pointers
    z_ptr, target_ptr, inv_t_ptr, buf_ptr, stats_ptr, count_ptr, idx_ptr, lp_ptr, tlp_ptr,
    # sizes and options
    V, k, ignore_index, scale, cap,
    # strides
    stride_z,
    # meta-parameters
    HAS_TARGET: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr,
    SUB: tl.constexpr, C: tl.constexpr, RANKED: tl.constexpr,
):
    """_candidates_kernel's rows -> the top-k classes (n, k) int64, their log-probs
    (n, k) and the target's log-prob (n,) float32. RANKED the candidates ranked at a
    time."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    buf = buf_ptr + row * C
    inv_t = tl.load(inv_t_ptr + row)
    m = tl.load(stats_ptr + 4 * row)
    ls = tl.load(stats_ptr + 4 * row + 1)
    t = tl.load(stats_ptr + 4 * row + 2)
    n_gt = tl.load(count_ptr + row)
    n_tie = tl.zeros([], tl.int32)
    # n_gt >= k unless the sweeps computed a class's value differently (a guard, as the
    # loop's lo <= hi)
    if (n_gt > C) | (n_gt < k):
        # the ordered compaction, then (rarely) bisection sweeps until the candidates fit
        lo = _key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)  # count(u >= -inf) = V
        hi = _key(tl.load(stats_ptr + 4 * row + 3)).to(tl.int64)
        mid = _key(t).to(tl.int64)
        todo = (n_gt > C) | (n_gt < k)
        # lo <= hi: a guard against a hang should a sweep count otherwise than another
        while todo & (lo <= hi):
            n_gt, n_eq = _compact(z_row, buf, V, _unkey(mid.to(tl.int32)), k, scale,
                                  inv_t, cap, HAS_CAP, BLOCK_V, SUB, C)
            if n_gt + n_eq >= k:
                lo = mid
            else:
                hi = mid - 1
            mid = lo + (hi - lo + 1) // 2
            todo = (n_gt + n_eq < k) | (n_gt + tl.minimum(n_eq, k) > C)
            n_tie = tl.minimum(n_eq, k)
            tl.debug_barrier()  # this sweep's scratch stores before the next's

    # the candidates (slots [0, n_gt) and [C - n_tie, C)) ranked among each other by
    # their keys, which are distinct: rank r < k is the r-th of the top-k, in the tie rule
    # (the guard's exit may leave more counted than slots: never read past the row's)
    n_gt = tl.minimum(n_gt, C)
    n_tie = tl.minimum(n_tie, C - n_gt)
    n = n_gt + n_tie
    j = tl.arange(0, C)
    keys = tl.load(buf + _slot(j, n_gt, C), mask=j < n, other=_EMPTY)
    ri = tl.arange(0, RANKED)
    for i0 in range(0, n, RANKED):
        mine = tl.load(buf + _slot(i0 + ri, n_gt, C), mask=i0 + ri < n, other=_EMPTY)
        rank = tl.sum((keys[None, :] > mine[:, None]).to(tl.int32), axis=1)
        out = row * k + rank
        write = (i0 + ri < n) & (rank < k)
        tl.store(idx_ptr + out, 0x7FFFFFFF - (mine & 0x7FFFFFFF), mask=write)
        value = _unkey((mine >> 32).to(tl.int32))
        tl.store(lp_ptr + out, (value - m) - ls, mask=write)  # relative to the max

    lp_y = 0.0
    if HAS_TARGET:
        y = tl.load(target_ptr + row).to(tl.int64)
        valid = y != ignore_index
        in_range = (y >= 0) & (y < V)
        u_y = _load_a(z_row + tl.where(valid & in_range, y, 0), True, scale, cap,
                      HAS_CAP) * inv_t
        # out-of-range targets never read out of bounds: they poison the row with NaN
        lp_y = tl.where(valid, tl.where(in_range, (u_y - m) - ls, float("nan")), 0.0)
    tl.store(tlp_ptr + row, lp_y)


def _launch_sizes(V, k, warps=_WARPS[1]):
    """(BLOCK_V, SUB, G, C): SUB the ordered compaction's pieces, 4 classes a thread;
    G = 4k groups (k rounded up to a power of two) bound the k-th value closely at a
    top-K of G floats per row; C = 4k slots hold the classes at or above the bound (on
    random rows of V = 2^18 about 1.15 k, 1.9 k on tie-heavy bfloat16 ones) and always
    the exact k-th value's (C >= 2k - 1). All three at least 128: small top-Ks cost
    little."""
    block_v = max(_block_v(V), 128)
    kk = max(triton.next_power_of_2(k), 32)
    return block_v, min(block_v, 4 * warps * 32), min(block_v, 4 * kk), 4 * kk


def triton_topk_rows(logits, target, inv_t, opts, math_dtype, shard=ONE_DEVICE,
                     groups=None, slots=None, warps=_WARPS, block=None, stages=_STAGES):
    """topk_rows (rows.py) on the Triton kernels: logits (n, V) with unit stride
    along V (a shard's classes), opts a TopKOptions; float32 math. groups, slots: G and
    C (powers of two; tests force the bisection with small ones); warps: the two
    kernels'; block, stages: the sweep's classes a step and software pipeline (a probe
    varies them: bench/probes/topk_kernel.py)."""
    n, V = logits.shape
    sharded = shard.group is not None
    k = min(opts.k, V) if sharded else opts.k  # a shard narrower than k: all its classes
    assert math_dtype == torch.float32 and logits.stride(1) == 1
    assert 1 <= k <= V < 2 ** 31
    block_v, sub, G, C = _launch_sizes(V, k, warps[1])
    G, C = groups or G, slots or C
    sweep_v = block or min(block_v, _BLOCK)
    K = max(triton.next_power_of_2(k), 2)  # triton 3.6's tl.topk fails for K = 1
    assert K <= G <= min(block_v, sweep_v) and C >= 2 * k - 1
    indices = logits.new_empty((n, k), dtype=torch.int64)
    logprobs = logits.new_empty((n, k), dtype=torch.float32)
    target_lp = logits.new_empty(n, dtype=torch.float32)
    if n == 0:  # every rank alike (they cut the same chunks): no collective
        return indices.new_empty(0, opts.k), logprobs.new_empty(0, opts.k), target_lp
    buf = logits.new_empty((n, C), dtype=torch.int64)
    inv_t = inv_t.float().contiguous()
    stats = logits.new_empty((n, 4), dtype=torch.float32)
    count = logits.new_empty(n, dtype=torch.int32)
    seg = logits.new_empty((n, triton.cdiv(V, _SEGMENT)), dtype=torch.float32)
    hit = logits.new_empty((n, C), dtype=torch.int32)
    options = (float(opts.logit_scale), float(opts.softcap or 1.0))
    _candidates_kernel[(n,)](
        logits, inv_t, buf, seg, hit, stats, count, V, k, *options, logits.stride(0),
        HAS_CAP=opts.softcap is not None, BLOCK_V=sweep_v, K=K, G=G, C=C, S=_SEGMENT,
        STEP=_STEP, STAGES=stages, num_warps=warps[0])
    ignore_index = opts.ignore_index
    if sharded:
        # the ranking then writes values, not log-probs ((u - 0) - 0 = u), and the
        # target's value where this shard holds it (a local column, -1 elsewhere)
        m, ls = stats[:, 0].clone(), stats[:, 1].clone()
        stats[:, :2] = 0.0
        y = target
        if y is not None:
            col = y - shard.vocab_start
            target = torch.where((y != opts.ignore_index) & (col >= 0) & (col < V), col, -1)
            ignore_index = -1
    _topk_rows_kernel[(n,)](
        logits, target_lp if target is None else target.contiguous(), inv_t, buf, stats,
        count, indices, logprobs, target_lp, V, k, ignore_index, *options,
        logits.stride(0), HAS_TARGET=target is not None, HAS_CAP=opts.softcap is not None,
        BLOCK_V=block_v, SUB=sub, C=C, RANKED=max(_RANKED // C, 1), num_warps=warps[1])
    if not sharded:
        return indices, logprobs, target_lp
    # the shards' (m, s) merged into the row's (with the target's value: the rank
    # holding it gives it, the others 0); log-probs formed as one device's
    m, s, _, u_y = all_reduce_sums(m, ls.exp(), torch.zeros_like(m), shard, target_lp)
    ls = s.log()
    indices, values = merged(indices + shard.vocab_start, logprobs, opts.k, shard)
    logprobs = (values - m[:, None]) - ls[:, None]
    if y is None:
        return indices, logprobs, torch.zeros_like(target_lp)
    # as one device: 0 where ignored, NaN outside [0, V) (nothing read out of bounds)
    in_range = (y >= 0) & (y < shard.vocab_size)
    return indices, logprobs, torch.where(y != opts.ignore_index,
                                          torch.where(in_range, (u_y - m) - ls, math.nan), 0.0)

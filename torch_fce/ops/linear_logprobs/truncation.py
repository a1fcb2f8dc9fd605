"""The sampler's truncation as row math: the log-probs, entropy and logits gradient of
the distribution vLLM's sampler draws from under min_p, top_k and top_p (its
`processed_logprobs`).

With z = softcap(l) / T the processed logits of a row, the classes ordered by z
descending and equal values by ascending class, vLLM applies, in this order:
  min_p  keep z_j >= max z + log(min_p)   (p_j >= min_p p_max; ties all kept)
  top_k  keep the first k                   (exactly k: ties by ascending class)
  top_p  renormalised over the classes kept so far, keep the shortest prefix whose mass
         reaches top_p: j is kept while the mass before it is < top_p (the most likely
         class always)
Each rule keeps a prefix of that order, so the kept set K is one: a row's K is its last
class (v, c), j kept iff z_j > v or (z_j == v and j <= c), a threshold every vocabulary
tile or shard applies alone. Over K the row's statistics are those of logits set to
-inf outside it: log q_K(y) = (z_y - m) - log s_K (-inf for y outside K, with no
gradient), H_K = log s_K - d_K, and the gradient the untruncated one's with q_K for p.

The candidates are the first k classes (the top-k rows, k <= MAX_CANDIDATES) or,
with a larger top_k, the whole row sorted on one device. Without a top-k (top_p and
min_p only) the rows find K without a sort of the row: the Triton rows by sweeps of it
(truncation_kernels.py: bisection on top_p's mass), the PyTorch rows on the CPU from
its largest classes or value buckets (truncation_rows.torch_thresholds; off the CPU
they sort it). A vocabulary shard
without top-k candidates finds (v, c) by a search of values (sharded_kept_stats: the
group's counts and masses above a value, each rank's tally of its classes all-reduced:
the PyTorch rows' a search of them sorted once, the Triton rows' a sweep of them). A
TruncationRows family gives them and the gradient on one backend: the PyTorch members
in truncation_rows.py, the Triton ones in kernels.py (every device and shard they run
on: `serves`).
The forward's candidate values and the backward's recomputed z come from the same
backend's formula, so the backward's threshold test sees the forward's bits.
"""

import math
from typing import Callable, NamedTuple, Optional

import torch

from ..loop.chunked import ONE_DEVICE, logits_bytes
from ..linear_topk_logprobs.rows import at_classes
from ..rowmath.common import row_sum, softcapped

MAX_CANDIDATES = 256  # the top-k rows' largest k
# row_stats' columns after the log-probs' (m, log s_K, d_K): the kept set's last class
# (v, c), whether the target is kept (1.0 / 0.0) and its untruncated log-prob (for an
# integration wanting both from one pass); c is exact in float32 below 2^24.
ROW_STATS, MODEL_LOGPROB = 7, 6


class TopKRecord(NamedTuple):
    """The top-k rows' options record (TopKOptions' fields they read)."""
    k: int
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    ignore_index: int = -100


def truncating(opts):
    """Whether the options record (top_k, top_p, min_p) truncates at all."""
    return (opts.top_k is not None or opts.top_p not in (None, 1.0)
            or opts.min_p not in (None, 0.0))


def whole_row_sort(opts, vocab_size):
    """Whether the candidates are the whole row sorted (no top-k rows can bound K)."""
    return not (opts.top_k is not None and min(opts.top_k, vocab_size) <= MAX_CANDIDATES)


def no_top_k(opts, vocab_size):
    """Whether top_k keeps every class (None or >= V): K is a threshold of the row."""
    return opts.top_k is None or opts.top_k >= vocab_size


class TruncationRows(NamedTuple):
    """The truncation's row functions on one backend (logits (n, cols) the loop's
    buffer, left intact; target whole-vocabulary classes; inv_t (n,) 1/T).
      candidates(logits, target, inv_t, opts, math_dtype, shard)
          -> (values, classes, z_y, logprob): the processed logits of the row's first
          candidates (n, L) in the order (z desc, class asc), their classes, z at each
          target (0 where ignored or out of range) and the target's untruncated
          log-prob (n,)
      grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype, col0,
           dz_dtype) -> dz of the classes [col0, col0 + cols) from the forward's
          row_stats (n, ROW_STATS), as LogProbRows.grad's over K
      per_logit: the chunk's bytes per logit beyond the logits and a dz written over
          them (a dz buffer of its own, for logits wider than dz, is counted apart)
      thresholds(logits, target, inv_t, opts, math_dtype) -> kept_stats' outputs
          without a top-k (top_p, min_p) and without candidates (None: the whole row
          sorted instead)
      thresholds_per_logit: the bytes per logit thresholds holds beyond per_logit
      processed(logits, opts, inv_t, math_dtype) -> (z, top, col, m): z (n, cols)
          float32, the processed logits in grad's formula (a copy: logits stays
          intact); each row's first maximum (NaN as -inf) and its column, and its max
          (NaN where the row holds one)
      tally(z, top, search) -> above: a vocabulary shard's search of values
          (sharded_kept_stats) over processed's z, top (n,) the group's max, search
          whether one follows (else three values alone); above(t) of values t (n, P) ->
          this rank's (count, mass, g) of its classes with z > t, mass their
          exp(z - top) and g their exp(z - top) (z - top), each (n, P) float32 (None:
          the PyTorch rows search instead)
      tally_per_logit: the bytes per logit that search holds beyond per_logit
      search(z, top, lo, goal, mass, reduce) -> u: _smallest_below over [lo, top] of
          the group's count (mass False) or mass of the classes above a value, each
          round this rank's tally summed by reduce (the group's all-reduce), in
          _smallest_below's rounds and points (None: _smallest_below over tally's)"""
    candidates: Callable
    grad: Callable
    per_logit: int
    thresholds: Optional[Callable] = None
    thresholds_per_logit: int = 0
    processed: Optional[Callable] = None
    tally: Optional[Callable] = None
    tally_per_logit: int = 0
    search: Optional[Callable] = None


def _processed(logits, opts, inv_t, math_dtype):
    """(z, tanh): z = softcap(l) / T in math_dtype (a copy: logits stays intact), tanh
    for the softcap's derivative (None without one)."""
    z, tanh = softcapped(logits.to(math_dtype, copy=True), opts.softcap, math_dtype)
    return z.mul_(inv_t[:, None]), tanh


def _ordered(values, classes):
    """Candidates in vLLM's order: values descending, equal ones by ascending class."""
    key = torch.sort(classes, dim=-1, stable=True)
    values, classes = values.gather(1, key.indices), key.values
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), classes.gather(1, order)


def _by_thresholds(rows, opts, vocab_size, shard=ONE_DEVICE):
    """Whether rows find K without candidates (no top-k, one device, rows that can)."""
    return rows.thresholds is not None and shard.group is None and \
        whole_row_sort(opts, vocab_size) and no_top_k(opts, vocab_size)


def serves(rows, opts, shard, vocab_size):
    """Whether a backend's truncation rows serve these options (top-k candidates, on one
    device or a shard, or their own search of K); else the PyTorch ones do (forward and
    backward pick alike, every rank alike)."""
    if not whole_row_sort(opts, vocab_size):
        return True
    return rows.tally is not None if shard.group is not None else _by_thresholds(
        rows, opts, vocab_size)


def _kept(values, opts, kept_mass=None):
    """The candidates kept (n, L), a prefix of each row, by vLLM's rules in its order;
    kept_mass (n,): the mass top_p renormalises over, where the candidates are not the
    whole row (exp(z - m) summed over what min_p keeps)."""
    m = values[:, :1]
    kept = values > float("-inf")
    if opts.min_p not in (None, 0.0):
        kept &= values >= m + math.log(opts.min_p)
    if opts.top_p not in (None, 1.0):
        e = torch.where(kept, (values - m).exp(), 0.0)
        before = e.cumsum(-1) - e  # the mass before each candidate
        kept &= before < opts.top_p * (row_sum(e, True) if kept_mass is None
                                       else kept_mass[:, None])
    kept[:, 0] = True  # the most likely class (also of a row of -inf)
    return kept


def kept_stats(rows, logits, target, inv_t, opts, math_dtype, shard=ONE_DEVICE):
    """(logprob, entropy, lse, argmax, row_stats) of a chunk's rows under the
    truncation, as LogProbRows.stats' over K (rows: a TruncationRows); row_stats (n,
    ROW_STATS). The logits stay intact (for a gradient from the same chunk)."""
    V = logits.shape[1] if shard.group is None else shard.vocab_size
    if _by_thresholds(rows, opts, V, shard):
        return rows.thresholds(logits, target, inv_t, opts, math_dtype)
    if shard.group is not None and whole_row_sort(opts, V):
        return sharded_kept_stats(rows, logits, target, inv_t, opts, math_dtype, shard)
    values, classes, z_y, logprob_all = rows.candidates(logits, target, inv_t, opts,
                                                        math_dtype, shard)
    values, classes = _ordered(values, classes)
    kept = _kept(values, opts)
    last = kept.sum(-1, keepdim=True) - 1
    m = values[:, 0].clamp_min(torch.finfo(math_dtype).min)  # finite if all -inf
    x = values - m[:, None]
    e = torch.where(kept, x.exp(), 0.0)
    return kept_outputs(m, row_sum(e), row_sum(torch.where(e > 0, e * x, 0.0)),
                        values.gather(1, last)[:, 0],
                        classes.gather(1, last)[:, 0].to(math_dtype), z_y, logprob_all,
                        classes[:, 0], target, opts, V)


def kept_outputs(m, s, ez, v, c, z_y, logprob_all, argmax, target, opts, vocab_size):
    """kept_stats' outputs from a row's max m, K's sums s of exp(z - m) and ez of
    exp(z - m) (z - m), its last class (v, c), z and the untruncated log-prob at the
    target and the argmax (each (n,))."""
    log_s = s.log()
    d = ez / s
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < vocab_size)
    y_kept = in_range & ((z_y > v) | ((z_y == v) & (target <= c)))

    def outputs(lp):  # 0 where ignored, NaN where the target is out of range
        return torch.where(valid, torch.where(in_range, lp, float("nan")), 0.0)

    # a row holding a NaN (its sums NaN): NaN, as the untruncated log-probs
    logprob = outputs(torch.where(y_kept | log_s.isnan(), (z_y - m) - log_s, float("-inf")))
    entropy = torch.where(valid, log_s - d, 0.0)
    row_stats = torch.stack([m, log_s, d, v, c, (y_kept & valid).to(m.dtype),
                             outputs(logprob_all)], 1)
    return logprob, entropy, m + log_s, argmax, row_stats


def per_logit(rows, logits_dtype, dz_dtype, opts, vocab_size, shard=ONE_DEVICE):
    """The chunk's bytes per logit under the truncation rows `rows` (chunk_rows_for's
    per_logit; None without a truncation, the loop's own): the logits, dz where it has
    a buffer of its own (logits wider than dz), the rows' temporaries, and the whole
    row's sort (values, classes, the sort's own; a shard's: its values, classes and
    masses) where the candidates are that."""
    if rows is None:
        return None
    if not whole_row_sort(opts, vocab_size):
        sort = 0
    elif _by_thresholds(rows, opts, vocab_size, shard):
        sort = rows.thresholds_per_logit
    elif shard.group is not None:
        sort = rows.tally_per_logit
    else:
        sort = 24
    return logits_bytes(logits_dtype, dz_dtype) + rows.per_logit + sort


# ---- a vocabulary shard without top-k candidates: K's last class by a search of values

def sharded_kept_stats(rows, logits, target, inv_t, opts, math_dtype, shard):
    """kept_stats on a vocabulary shard where no top-k rows bound K (top_p or min_p
    without top_k, or top_k > MAX_CANDIDATES), on the TruncationRows rows (their z, their
    tally). The group's count and mass of the classes above a value t (above(t)) are each
    rank's tally of its classes (the PyTorch rows: a search of them sorted once; the
    Triton ones: a sweep) and one all-reduce. With H(t) either, nonincreasing and
    constant between the row's values, a prefix of the order ends at the smallest value
    u with H(u) < its goal (_smallest_below: a fixed number of rounds, no host sync):
      min_p  the classes at or above the floor m + log(min_p): n1 of them (min_p alone:
             K is those, v their smallest value, no search)
      top_k  v2: the goal n2 = min(k, n1) in counts, over [floor, m]; n2 - count(z > v2)
             of its ties kept
      top_p  v: the goal T = top_p S2 in masses, over [v2, m] (S2 the first n2's mass;
             v2 the floor without top_k);
             of v's ties the first by class while the mass before each, H(v) + i
             exp(v - m), is < T (masses summed in another order than one device's: a
             boundary met within rounding may fall on the other side)
    c is the last kept tie's class (_nth_tie). K's sums are the tally's above v and its
    kept ties' (so no pass of the chunk of its own). NaN is ranked as -inf; a row holding
    one gives NaN, as on one device."""
    z, mine, col, m = rows.processed(logits, opts, inv_t, math_dtype)
    V = shard.vocab_size
    # the search's max (NaN-free) and the sums' (NaN where the row holds one)
    top, m = shard.all_reduce(torch.stack([mine, m]), "max").clamp_min(
        torch.finfo(math_dtype).min).unbind(0)
    argmax = shard.all_reduce(torch.where(mine == top, col + shard.vocab_start, V), "min")
    floor = (top + math.log(opts.min_p) if opts.min_p not in (None, 0.0)
             else torch.full_like(top, -math.inf)).clamp_min(torch.finfo(math_dtype).min)
    top_k = opts.top_k is not None and opts.top_k < V
    top_p = opts.top_p not in (None, 1.0)
    local = rows.tally(z, top, top_k or top_p)

    def above(t):  # values (n, P) -> the group's (count, mass, g) of z > t, each (n, P)
        return shard.all_reduce(torch.stack(local(t.contiguous())), "sum").unbind(0)

    def smallest_below(lo, goal, mass):  # the group's u over [lo, top] (_smallest_below)
        if rows.search is not None:
            return rows.search(z, top, lo, goal, mass, lambda x: shard.all_reduce(x, "sum"))
        return _smallest_below(lambda t: above(t)[int(mass)], lo, top, goal)
    # n1: the finite classes at or above the floor; the row's whole mass: above -inf;
    # for top_p alone also the sums above the floor (K's; the others tally v below)
    first = [_below(floor), torch.full_like(floor, -math.inf)]
    cnt, ms, g = above(torch.stack(first + ([floor] if top_p and not top_k else []), 1))
    n1, s_all = cnt[:, 0], ms[:, 1]
    cnt, ms, g = cnt[:, -1], ms[:, -1], g[:, -1]
    v = floor  # the searches' lower end: H(_below(floor)) counts the n1
    if not (top_k or top_p):  # min_p alone: K those n1, v their smallest value u0
        v = shard.all_reduce(torch.where(z >= floor[:, None], z, math.inf).amin(-1), "min")
    goal = n1
    if top_k:
        goal = n1.clamp_max(opts.top_k)
        v = smallest_below(v, goal, False)
    if top_k or not top_p:
        cnt, ms, g = (x[:, 0] for x in above(v[:, None]))
    ties = goal - cnt  # v's ties in the prefix so far
    if top_p:
        v2 = v
        goal = opts.top_p * (ms + ties * (v2 - top).exp())
        v = smallest_below(v2, goal, True)
        cnt, ms, g = above(torch.stack([v, _below(v)], 1))
        avail = torch.where(v == v2, ties, cnt[:, 1] - cnt[:, 0])
        e = (v - top).exp()
        ties = torch.where(e > 0, ((goal - ms[:, 0]) / e).ceil().clamp_min(1.0), avail)
        ties = torch.minimum(ties, avail)
        ms, g = ms[:, 0], g[:, 0]
    empty = n1 == 0  # every class -inf: the first class alone, as on one device
    v = torch.where(empty, -math.inf, v)
    ties = torch.where(empty, 0.0, ties)
    c = torch.where(empty, 0.0, _nth_tie(z, v, ties, shard).to(math_dtype))
    # K's sums: the group's above v and v's kept ties, relative to top, then to m (the
    # same, or NaN where the row holds one)
    e = (v - top).exp()
    drift = top - m
    s = (ms + ties * e) * drift.exp()
    ez = g + torch.where(e > 0, ties * e * (v - top), 0.0) + drift
    valid = target != opts.ignore_index
    read = valid & (target >= 0) & (target < V)
    z_y = at_classes(z, target[:, None], read[:, None], shard)[:, 0]
    logprob_all = (z_y - top) - s_all.log() + (m - top)  # + NaN where the row holds one
    return kept_outputs(m, s, ez, v, c, z_y, logprob_all, argmax, target, opts, V)


def _image(x):
    """The order-preserving int64 image of float32 / float64 x (not NaN), -0.0 and +0.0
    as one: adjacent floats have adjacent images."""
    ints = torch.int32 if x.dtype == torch.float32 else torch.int64
    bits = x.view(ints).long()
    return torch.where(bits < 0, torch.iinfo(ints).min - bits, bits)


def _from_image(k, dtype):
    ints = torch.int32 if dtype == torch.float32 else torch.int64
    return torch.where(k < 0, torch.iinfo(ints).min - k, k).to(ints).view(dtype)


def _below(x):
    """The largest float below x (x finite or +inf): classes > _below(x) are those >= x."""
    return _from_image(_image(x) - 1, x.dtype)


def _smallest_below(H, lo, hi, goal):
    """The smallest value u in [lo, hi] (n,) of a row with H(u) < goal (n,), H(t) (n, P)
    nonincreasing in t, given H(_below(lo)) >= goal > H(hi): eighths of the bracket of
    their images (a round's seven points, one tally and one all-reduce), which narrows
    it to two adjacent images in a fixed number of rounds (11 and 22 from the widest
    float32 and float64 brackets, one more each kept)."""
    dtype = lo.dtype
    lo, hi = _image(lo) - 1, _image(hi)
    for _ in range(search_rounds(dtype)):
        points = eighths(lo, hi)
        lo, hi = narrowed(lo, hi, points, H(_from_image(points, dtype)) < goal[:, None])
    return _from_image(hi, dtype)


def search_rounds(dtype):
    return 12 if dtype == torch.float32 else 23


def eighths(lo, hi):
    """A round's seven points (n, 7) cutting the bracket (lo, hi] of images (n,) in
    eighths: an eighth of it, and (narrow ones) its width, without overflow."""
    k = torch.arange(1, 8, device=lo.device)
    eighth = ((hi >> 3) - (lo >> 3))[:, None]
    d = eighth.clamp_max(16) * 8 + ((hi & 7) - (lo & 7))[:, None]
    wide = torch.cat([lo[:, None] + eighth, eighth.expand(-1, 6)], 1).cumsum(1)
    return torch.where(eighth < 16, lo[:, None] + (k * d // 8).clamp_min(1), wide)


def narrowed(lo, hi, points, under):
    """The bracket (lo, hi] of images drawn in to the points (n, 7) at which H < goal
    (under) and those at which not."""
    return (torch.where(under, lo[:, None], points).amax(-1),
            torch.where(under, points, hi[:, None]).amin(-1))


def _nth_tie(z, v, nth, shard):
    """The class of the group's nth (n,) class with z == v (n,) by class order, from
    each rank's count of them gathered beside its first class."""
    tie = z == v[:, None]
    counts = tie.sum(-1)
    start = torch.full((1,), shard.vocab_start, dtype=counts.dtype, device=z.device)
    gathered = shard.all_gather(torch.cat([start, counts])[None])  # (world, n + 1)
    before = torch.where(gathered[:, :1] < shard.vocab_start, gathered[:, 1:], 0).sum(0)
    j = nth.long() - before  # this rank's jth tie, if it holds it
    col = (tie.cumsum(-1, dtype=torch.int32) < j[:, None]).sum(-1)
    return shard.all_reduce(torch.where((j >= 1) & (j <= counts), col + shard.vocab_start,
                                        -1), "max")

"""The sampler's truncation rows in PyTorch (any device, any vocabulary shard): the
candidates, the gradient over K, K found without a sort of the row where no top-k
bounds it (torch_thresholds), and a shard's tally for the search of values
(torch_tally); vLLM's rules themselves and the outputs they give are truncation.py's."""

import math

import torch

from ..loop.chunked import ONE_DEVICE
from ..linear_topk_logprobs.rows import at_classes, topk_rows
from ..rowmath.common import first_max, row_sum
from .rows import logits_grad
from .truncation import (TopKRecord, TruncationRows, _kept, _ordered, _processed,
                         kept_outputs, whole_row_sort)


def torch_candidates(logits, target, inv_t, opts, math_dtype, shard=ONE_DEVICE):
    """TruncationRows.candidates in PyTorch (also a shard's: the top-k rows merge the
    group's candidates)."""
    z, _ = _processed(logits, opts, inv_t, math_dtype)
    V = z.shape[1] if shard.group is None else shard.vocab_size
    valid = target != opts.ignore_index
    read = valid & (target >= 0) & (target < V)
    z_y = at_classes(z, target[:, None], read[:, None], shard)[:, 0]
    if whole_row_sort(opts, V):
        assert shard.group is None
        values, classes = torch.sort(z, dim=-1, descending=True, stable=True)
        m = values[:, :1].clamp_min(torch.finfo(z.dtype).min)
        log_s = row_sum(z.sub_(m).exp_()).log()
        k = V if opts.top_k is None else min(opts.top_k, V)
        return values[:, :k], classes[:, :k], z_y, (z_y - m[:, 0]) - log_s
    ones = torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    classes, _, lp = topk_rows(z, target, ones, TopKRecord(
        min(opts.top_k, V), ignore_index=opts.ignore_index), z.dtype, shard)
    return at_classes(z, classes, shard=shard), classes, z_y, lp


def torch_kept_grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype, col0,
                    dz_dtype):
    """TruncationRows.grad in PyTorch."""
    z, tanh = _processed(logits, opts, inv_t, math_dtype)
    v, c = row_stats[:, 3:4], row_stats[:, 4:5]
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device, dtype=math_dtype)
    outside = (z < v) | ((z == v) & (cols > c))
    z = z.sub_(row_stats[:, :1]).masked_fill_(outside, float("-inf"))  # z - m over K
    g = torch.where(row_stats[:, 5] > 0, g_lp, 0.0)
    return logits_grad(z, tanh, dz_dtype, target, inv_t, opts, g, g_h, row_stats[:, :3],
                       col0)


def torch_thresholds(logits, target, inv_t, opts, math_dtype):
    """TruncationRows.thresholds in PyTorch. min_p alone: K is every class at or above
    max z + log(min_p). top_p (_top_p_cut): on the CPU without a sort of the row (a
    sort took 6x the untruncated forward at 2048 x 256 x 32000 on a 2-core CPU), off it
    by the whole row sorted. Each row's (v, c) is exact and found alike in any batch;
    K's sums are then over the whole row in class order: the same bits however K was
    found."""
    z, _ = _processed(logits, opts, inv_t, math_dtype)
    n, V = z.shape
    read = (target != opts.ignore_index) & (target >= 0) & (target < V)
    z_y = at_classes(z, target[:, None], read[:, None])[:, 0]
    top, argmax = first_max(z)
    top = top[:, None]
    m = top.clamp_min(torch.finfo(math_dtype).min)  # finite if all -inf
    e = (z - m).exp_()
    total = row_sum(e)  # the untruncated sum: the target's untruncated log-prob
    cols = torch.arange(V, device=z.device)
    min_p = opts.min_p not in (None, 0.0)
    floor = top + math.log(opts.min_p) if min_p else None  # _kept's test, on its max
    if opts.top_p in (None, 1.0):  # min_p alone (or a top_k >= V alone: every class):
        # ties all kept, the last the largest class
        v = torch.where(z >= floor if min_p else z == z, z, math.inf).amin(-1, keepdim=True)
        c = torch.where(z == v, cols, -1).amax(-1, keepdim=True)
    else:
        mass = e if not min_p else torch.where(z >= floor, e, 0.0)
        v, c = _top_p_cut(z, top, mass, row_sum(mass), floor, opts)
    e.masked_fill_((z < v) | ((z == v) & (cols > c)), 0.0)  # exp(z - m) over K
    x = z.sub_(m)
    ez = row_sum(torch.where(e > 0, e * x, 0.0))
    # a row holding a NaN: its sums NaN, as the untruncated log-probs (total is NaN)
    s = row_sum(e) + 0.0 * total
    return kept_outputs(m[:, 0], s, ez, v[:, 0], c[:, 0].to(math_dtype), z_y,
                        (z_y - m[:, 0]) - total.log(), argmax, target, opts, V)


_PEAKED = 256  # the largest classes that settle a peaked row's top_p cut


def _top_p_cut(z, top, mass, kept_mass, floor, opts):
    """((n, 1) v, c): top_p's last class (min_p's test within _kept). On the CPU from
    the row's 256 largest classes where K ends above the last one's value (then no
    class beyond them can be in K or tie its last: a peaked row), else from
    _bucket_cut's (a flat row; choosing those rows costs no device sync there); off
    the CPU from the whole row sorted. top (n, 1) the rows' max, mass (n, V) exp(z - m)
    where min_p keeps the class (else 0), kept_mass its row sums, floor min_p's value
    (or None)."""
    cpu = z.device.type == "cpu"
    values, classes = _ordered(*torch.topk(z, min(_PEAKED, z.shape[1]), dim=-1)) if cpu \
        else torch.sort(z, dim=-1, descending=True, stable=True)
    last = _kept(values, opts, kept_mass).sum(-1, keepdim=True) - 1
    v, c = values.gather(1, last), classes.gather(1, last)
    flat = (v <= values[:, -1:])[:, 0] & (values.shape[1] < z.shape[1])
    if cpu and bool(flat.any()):
        rows = flat.nonzero()[:, 0]
        v[rows], c[rows] = _bucket_cut(z[rows], top[rows], mass[rows], kept_mass[rows],
                                       None if floor is None else floor[rows], opts)
    return v, c


_BUCKETS, _SPAN = 2048, 64.0  # value buckets of z within _SPAN below the max


def _bucket_cut(z, top, mass, kept_mass, floor, opts):
    """((n, 1) v, c) of top_p's cut from value buckets: each class's bucket a
    nondecreasing function of its value (equal values share one, a higher bucket holds
    only higher values), the buckets' masses summed, the bucket where the mass from the
    top reaches top_p of kept_mass found, and the cut among its classes in vLLM's order,
    the mass before each one the higher buckets' plus its predecessors' there."""
    n, V = z.shape
    b = ((z - (top - _SPAN)) * (_BUCKETS / _SPAN)).floor_()
    b = b.nan_to_num_(0.0, _BUCKETS - 1, 0.0).clamp_(0, _BUCKETS - 1).long()
    per_bucket = z.new_zeros(n, _BUCKETS).scatter_add_(1, b, mass)
    # the mass of the buckets at and above each, and above each (0 above the last)
    from_top = per_bucket.flip(-1).cumsum(-1).flip(-1)
    above_each = torch.cat([from_top[:, 1:], from_top.new_zeros(n, 1)], 1)
    need = opts.top_p * kept_mass[:, None]
    cut = ((from_top >= need).sum(-1, keepdim=True) - 1).clamp_(0, _BUCKETS - 1)
    inside = b == cut
    k = int(inside.sum(-1).max())  # on the CPU: no device to wait for
    values, classes = _ordered(*torch.topk(torch.where(inside, z, -math.inf), k, dim=-1))
    real = values > -math.inf  # (the rows with fewer classes there: -inf after them)
    if floor is not None:
        real &= values >= floor
    e = torch.where(real, mass.gather(1, classes), 0.0)
    before = above_each.gather(1, cut) + e.cumsum(-1) - e
    last = ((before < need) & real).sum(-1, keepdim=True).clamp_min(1) - 1
    return values.gather(1, last), classes.gather(1, last)


def torch_processed(logits, opts, inv_t, math_dtype):
    """TruncationRows.processed in PyTorch: z (a copy), its first maxima."""
    z = _processed(logits, opts, inv_t, math_dtype)[0]
    mine, col = first_max(z)
    return z, mine, col, z.amax(-1)


def torch_tally(z, top, search):
    """TruncationRows.tally in PyTorch: with a search to come, a search of the shard's -z
    sorted once (NaN as -inf) with the sums before each (in float64: K's sums are read
    from them); without one (min_p alone: three values), the classes' masses and their
    g formed once and a few passes of them a value."""
    if not search:
        x = z - top[:, None]
        e = x.exp()
        ex = x.mul_(e).masked_fill_(e == 0, 0.0)  # (exp(-inf) (-inf): 0)

        def passes(t):
            sums = []
            for q in t.unbind(1):
                up = z > q[:, None]  # (NaN: never)
                sums.append((up.sum(-1, dtype=torch.int32).to(z.dtype),
                             row_sum(torch.where(up, e, 0.0)),
                             row_sum(torch.where(up, ex, 0.0))))
            return [torch.stack(col, 1) for col in zip(*sums)]
        return passes
    neg, mass, g = _sorted_sums(z, top)

    def above(t):
        cnt = torch.searchsorted(neg, -t, side="left")  # z > t <=> -z < -t
        return cnt.to(z.dtype), mass.gather(1, cnt), g.gather(1, cnt)
    return above


def _sorted_sums(z, top):
    """-z sorted ascending (NaN as -inf), and the mass and g of the classes before each."""
    neg = torch.sort(torch.where(z.isnan(), math.inf, -z), dim=-1).values
    x = neg.neg().sub_(top[:, None])  # z - top, descending
    e = x.exp()
    zero = neg.new_zeros(z.shape[0], 1)
    mass = torch.cat([zero, e.cumsum(-1, dtype=torch.float64).to(z.dtype)], 1)
    g = x.mul_(e).masked_fill_(e == 0, 0.0).cumsum(-1, dtype=torch.float64).to(z.dtype)
    return neg, mass, torch.cat([zero, g], 1)


# the processed logits' copy, a few float32 / bool temporaries of the chunk's shape and
# dz (never written over the logits here); the threshold search's sort off the CPU; a
# shard's search: its sort (values and sums, their float64 cumsums) and the search's
# temporaries
TORCH_TRUNCATION_ROWS = TruncationRows(
    torch_candidates, torch_kept_grad, 16, torch_thresholds, thresholds_per_logit=24,
    processed=torch_processed, tally=torch_tally, tally_per_logit=32)

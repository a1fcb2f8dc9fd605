"""Per-row top-k of the log-softmax in plain PyTorch: a chunk's k most likely classes
and their log-probs (the teacher's side of top-k distillation). No gradient.

For a chunk of logits rows l (n, V) (after bias), with z = softcap(scale * l) / T:
  lse        = logsumexp(z)
  indices    = the k classes of largest z, by z descending, equal z by ascending class
  logprobs   = z[indices] - lse
  target_lp  = z[target] - lse   (0 where the target is ignore_index, NaN outside [0, V))
The tie rule makes the result a function of the values alone (torch.topk leaves the
order of equal values open): the classes strictly above the k-th largest value, then
the lowest-numbered classes equal to it until there are k, then a stable sort by value.
A vocabulary shard's rows give their own k candidates; every rank's are gathered and
merged by the same rule (index order, then a stable sort by value), and lse and z_y are
all-reduced, so every rank returns what one device does.
"""

import math

import torch

from ..loop.chunked import ONE_DEVICE
from ..rowmath.common import row_sum, softcapped


def topk_rows(logits, target, inv_t, opts, math_dtype, shard=ONE_DEVICE):
    """(indices (n, k) int64, logprobs (n, k), target_logprob (n,)) of a chunk's rows;
    target None: no target_logprob (zeros). logits (n, Vs) is the loop's buffer (a
    shard's classes) and may be overwritten; opts a TopKOptions (k, logit_scale,
    softcap, ignore_index)."""
    if opts.logit_scale != 1.0:
        logits = logits.to(math_dtype).mul_(opts.logit_scale)
    z, _ = softcapped(logits, opts.softcap, math_dtype)
    z = z.mul_(inv_t[:, None])
    m = shard.all_reduce(z.amax(-1, keepdim=True), "max").clamp_min(
        torch.finfo(math_dtype).min)
    lse = (m + shard.all_reduce(row_sum((z - m).exp_(), True), "sum").log())[:, 0]
    # selection ranks NaN as -inf (as the Triton kernel): NaN never compares, and a row
    # holding one would leave fewer than k chosen (its lse, so its log-probs, are NaN)
    indices, values = _topk_ascending_ties(torch.where(z.isnan(), -math.inf, z),
                                           min(opts.k, z.shape[1]))
    if shard.group is not None:
        indices, values = merged(indices + shard.vocab_start, values, opts.k, shard)
    logprobs = values - lse[:, None]
    if target is None:
        return indices, logprobs, torch.zeros_like(lse)
    valid = target != opts.ignore_index
    z_y = at_classes(z, target[:, None], valid[:, None], shard)[:, 0]
    # a target outside [0, V) gives NaN, as the other ops' (nothing read out of bounds)
    in_range = (target >= 0) & (target < (z.shape[1] if shard.group is None
                                          else shard.vocab_size))
    return indices, logprobs, torch.where(valid, torch.where(in_range, z_y - lse, math.nan),
                                          0.0)


def at_classes(z, classes, read=True, shard=ONE_DEVICE):
    """z at whole-vocabulary classes (n, k) of each row, from the rank holding each (a
    shard's z holds its classes); 0 where not read (a mask of classes' shape) or
    outside the vocabulary."""
    col = classes - shard.vocab_start  # the class's column in this shard
    here = read & (col >= 0) & (col < z.shape[1])
    z_c = torch.where(here, z.gather(1, torch.where(here, col, 0).long()), 0.0)
    return shard.all_reduce(z_c, "sum") if shard.group is not None else z_c


def merged(indices, values, k, shard):
    """The k of every rank's candidates (n, k_r) as one device picks them: the largest
    values, equal ones by ascending class (candidates a shard could not fill are padded
    with -inf at classes past the vocabulary, so they sort last)."""
    n, k_r = indices.shape
    if k_r < k:
        pad = k - k_r
        values = torch.cat([values, values.new_full((n, pad), -math.inf)], 1)
        indices = torch.cat([indices, shard.vocab_size + torch.arange(
            pad, device=indices.device).expand(n, pad)], 1)
    # (world * n, k) gathered in rank order, as (n, world * k)
    world = shard.world_size
    indices = shard.all_gather(indices).reshape(world, n, k).permute(1, 0, 2).reshape(n, -1)
    values = shard.all_gather(values).reshape(world, n, k).permute(1, 0, 2).reshape(n, -1)
    by_class = torch.sort(indices, dim=-1).indices
    indices, values = indices.gather(1, by_class), values.gather(1, by_class)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
    return indices.gather(1, order), values.gather(1, order)


def _topk_ascending_ties(z, k):
    """(indices, values) of the k largest entries of each row of z, by value descending
    and equal values by ascending index; no host sync (fixed shapes throughout)."""
    kth = torch.topk(z, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = z > kth
    # the lowest-numbered entries equal to the k-th value fill the rest of the k
    need = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    tied = z == kth
    chosen = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= need))
    # exactly k chosen per row: the k largest of -index among them, in ascending index
    cols = torch.arange(z.shape[-1], device=z.device, dtype=torch.int32)
    key = torch.where(chosen, -cols, torch.iinfo(torch.int32).min)
    indices = torch.topk(key, k, dim=-1).values.neg_().long()
    values = z.gather(1, indices)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return indices.gather(1, order), values.gather(1, order)

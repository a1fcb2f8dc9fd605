"""Per-row top-k of the log-softmax in plain PyTorch: a chunk's k most likely classes
and their log-probs (the teacher's side of top-k distillation). No gradient.

For a chunk of logits rows l (n, V) (after bias), with z = softcap(scale * l) / T:
  lse        = logsumexp(z)
  indices    = the k classes of largest z, by z descending, equal z by ascending class
  logprobs   = z[indices] - lse
  target_lp  = z[target] - lse   (0 where the target is ignore_index)
The tie rule makes the result a function of the values alone (torch.topk leaves the
order of equal values open): the classes strictly above the k-th largest value, then
the lowest-numbered classes equal to it until there are k, then a stable sort by value.
"""

import torch

from .ce import softcapped


def topk_rows(logits, target, inv_t, opts, math_dtype):
    """(indices (n, k) int64, logprobs (n, k), target_logprob (n,)) of a chunk's rows;
    target None: no target_logprob (zeros). logits (n, V) is the loop's buffer and may
    be overwritten; opts a TopKOptions (k, logit_scale, softcap, ignore_index)."""
    if opts.logit_scale != 1.0:
        logits = logits.to(math_dtype).mul_(opts.logit_scale)
    z, _ = softcapped(logits, opts.softcap, math_dtype)
    z = z.mul_(inv_t[:, None])
    lse = torch.logsumexp(z, -1)
    indices, values = _topk_ascending_ties(z, opts.k)
    logprobs = values - lse[:, None]
    if target is None:
        return indices, logprobs, torch.zeros_like(lse)
    valid = target != opts.ignore_index
    z_y = z.gather(1, torch.where(valid, target, 0)[:, None]).squeeze(1)
    return indices, logprobs, torch.where(valid, z_y - lse, 0.0)


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

"""The sampler's truncation as row math: the log-probs, entropy and logits gradient of
the distribution vLLM's sampler draws from under min_p, top_k and top_p (its
`processed_logprobs`), in plain PyTorch on every device (the top-k candidates from the
backend's top-k rows: the Triton kernel on CUDA).

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

The candidates are the first k classes (the backend's top-k rows, k <= MAX_CANDIDATES)
or, without top_k or with a larger one, the whole row sorted (one device: a shard would
need the group's whole row).
"""

import math
from typing import NamedTuple

import torch

from ..loop.chunked import ONE_DEVICE
from .ce import row_sum, softcapped
from .logprob import logits_grad

MAX_CANDIDATES = 256  # the top-k rows' largest k
# row_stats' columns after the log-probs' (m, log s_K, d_K): the kept set's last class
# (v, c), whether the target is kept (1.0 / 0.0) and its untruncated log-prob (for an
# integration wanting both from one pass); c is exact in float32 below 2^24.
ROW_STATS = 7


class _TopK(NamedTuple):
    """The top-k rows' options record, for candidates of already processed logits."""
    k: int
    logit_scale: float = 1.0
    softcap: None = None
    ignore_index: int = -100


def truncating(opts):
    """Whether the options record (top_k, top_p, min_p) truncates at all."""
    return (opts.top_k is not None or opts.top_p not in (None, 1.0)
            or opts.min_p not in (None, 0.0))


def whole_row_sort(opts, vocab_size):
    """Whether the candidates are the whole row sorted (no top-k rows can bound K)."""
    return not (opts.top_k is not None and min(opts.top_k, vocab_size) <= MAX_CANDIDATES)


def check_shard(opts, shard):
    """Raises where a vocabulary shard cannot find the kept set: among each shard's
    top-k candidates only (the whole row's sort is one device's)."""
    if shard.group is not None and truncating(opts) and whole_row_sort(opts,
                                                                       shard.vocab_size):
        raise ValueError(
            f"top_p and min_p vocab-parallel need top_k <= {MAX_CANDIDATES} (the kept set "
            f"is found among the shards' top-k candidates, else in the whole row sorted), "
            f"got top_k={opts.top_k}, top_p={opts.top_p}, min_p={opts.min_p}")


def _candidates(z, opts, topk, shard):
    """(values, classes, log_s) of z's first classes (n, L) in the order (z desc, class
    asc), and log sum exp(z - max z) over the whole row (n,)."""
    V = z.shape[1] if shard.group is None else shard.vocab_size
    if whole_row_sort(opts, V):
        assert shard.group is None
        values, classes = torch.sort(z, dim=-1, descending=True, stable=True)
        m = values[:, :1].clamp_min(torch.finfo(z.dtype).min)
        k = V if opts.top_k is None else min(opts.top_k, V)
        return values[:, :k], classes[:, :k], row_sum((z - m).exp_()).log()
    ones = torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    classes, logprobs, _ = topk(z, None, ones, _TopK(min(opts.top_k, V)), z.dtype, shard)
    log_s = -logprobs[:, 0]  # the most likely class's log-prob is -log s
    col = classes - shard.vocab_start
    here = (col >= 0) & (col < z.shape[1])
    values = torch.where(here, z.gather(1, torch.where(here, col, 0)), 0.0)
    if shard.group is not None:  # each class's z from the rank holding it
        values = shard.all_reduce(values, "sum")
    # the order of the rows' own values, equal ones by class (the kernel's may round
    # otherwise where a softcap was applied before it)
    key = torch.sort(classes, dim=-1, stable=True)
    values, classes = values.gather(1, key.indices), key.values
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), classes.gather(1, order), log_s


def _kept(values, opts):
    """The candidates kept (n, L), a prefix of each row, by vLLM's rules in its order."""
    m = values[:, :1]
    kept = values > float("-inf")
    if opts.min_p not in (None, 0.0):
        kept &= values >= m + math.log(opts.min_p)
    if opts.top_p not in (None, 1.0):
        e = torch.where(kept, (values - m).exp(), 0.0)
        before = e.cumsum(-1) - e  # the mass before each candidate
        kept &= before < opts.top_p * row_sum(e, True)
    kept[:, 0] = True  # the most likely class (also of a row of -inf)
    return kept


def _processed(logits, opts, inv_t, math_dtype):
    """(z, tanh): z = softcap(l) / T in math_dtype, tanh for the softcap's derivative
    (None without one). Overwrites logits where it can."""
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    return z.mul_(inv_t[:, None]), tanh


def kept_stats(logits, target, inv_t, opts, math_dtype, topk, shard=ONE_DEVICE):
    """(logprob, entropy, lse, argmax, row_stats, processed) of a chunk's rows under the
    truncation: as LogProbRows.stats' over K, row_stats (n, ROW_STATS), processed the
    chunk's (z, tanh) for kept_grad's reuse (logits overwritten where it can be). topk
    is the backend's top-k rows."""
    z, tanh = _processed(logits, opts, inv_t, math_dtype)
    values, classes, log_s_all = _candidates(z, opts, topk, shard)
    kept = _kept(values, opts)
    last = kept.sum(-1, keepdim=True) - 1
    m = values[:, 0].clamp_min(torch.finfo(math_dtype).min)  # finite if all -inf
    x = values - m[:, None]
    e = torch.where(kept, x.exp(), 0.0)
    s = row_sum(e)
    log_s = s.log()
    d = row_sum(torch.where(e > 0, e * x, 0.0)) / s
    valid = target != opts.ignore_index
    V = z.shape[1] if shard.group is None else shard.vocab_size
    in_range = (target >= 0) & (target < V)
    hit = kept & (classes == target[:, None])
    y_kept = hit.any(-1)
    x_y = _target_logit(z, target, valid & in_range, shard) - m  # 0 where not read

    def outputs(lp):  # 0 where ignored, NaN where the target is out of range
        return torch.where(valid, torch.where(in_range, lp, float("nan")), 0.0)

    logprob = outputs(torch.where(y_kept, x_y - log_s, float("-inf")))
    entropy = torch.where(valid, log_s - d, 0.0)
    row_stats = torch.stack([m, log_s, d, values.gather(1, last)[:, 0],
                             classes.gather(1, last)[:, 0].to(math_dtype),
                             (y_kept & valid).to(math_dtype), outputs(x_y - log_s_all)], 1)
    return logprob, entropy, m + log_s, classes[:, 0], row_stats, (z, tanh)


def _target_logit(z, target, read, shard):
    """z at each row's target (from the rank holding it), 0 where not read."""
    col = target - shard.vocab_start
    here = read & (col >= 0) & (col < z.shape[1])
    z_y = torch.where(here, z.gather(1, torch.where(here, col, 0)[:, None].long())[:, 0], 0.0)
    return shard.all_reduce(z_y, "sum") if shard.group is not None else z_y


def kept_grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype, col0,
              dz_dtype, processed=None):
    """dz of the classes [col0, col0 + cols) from the forward's row_stats (n,
    ROW_STATS): the log-probs' gradient with q_K for p (0 outside K), none from a
    target outside K. processed: kept_stats' (z, tanh) of these logits (consumed)."""
    z, tanh = processed or _processed(logits, opts, inv_t, math_dtype)
    v, c = row_stats[:, 3:4], row_stats[:, 4:5]
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device, dtype=math_dtype)
    outside = (z < v) | ((z == v) & (cols > c))
    z = z.sub_(row_stats[:, :1]).masked_fill_(outside, float("-inf"))  # z - m over K
    g = torch.where(row_stats[:, 5] > 0, g_lp, 0.0)
    return logits_grad(z, tanh, dz_dtype, target, inv_t, opts, g, g_h, row_stats[:, :3],
                       col0)


def per_logit(opts, vocab_size, logits_dtype, dz_dtype):
    """The chunk's bytes per logit under the truncation (chunk_rows_for's per_logit):
    the logits, dz, the float32 processed logits and temporaries, and the whole row's
    sort (values, classes, the sort's own) where the candidates are that."""
    sort = 24 if whole_row_sort(opts, vocab_size) else 0
    return logits_dtype.itemsize + dz_dtype.itemsize + 12 + sort

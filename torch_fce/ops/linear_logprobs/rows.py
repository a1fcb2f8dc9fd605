"""Per-row log-prob math in plain PyTorch (the rows of every device but CUDA with
Triton): the counterpart of the Triton log-prob row kernel (kernels.py).

For a chunk of logits rows l (n, V) (after bias), with z = softcap(l) / T (T the row's
temperature) and p = softmax(z):
  lse     = logsumexp(z)
  logprob = (z_y - m) - log s, m the row max, s = sum_c exp(z_c - m) (0 where ignored)
  entropy = -sum_c p_c log p_c = lse - mu, mu = sum_c p_c z_c   (0 where ignored)
  argmax  = argmax_c z_c (the first one), as an index
and for upstream gradients g (of logprob) and h (of entropy), zero where ignored:
  dl_c = (g * ([c == y] - p_c) - h * p_c * (z_c - mu)) * softcap'(l_c) / T
The backward takes the forward's row statistics relative to the row max m, (m, log s,
d) with s = sum_c exp(z_c - m) and d = mu - m, so it reads each recomputed logit once
and forms p_c = exp((z_c - m) - log s) and z_c - mu = (z_c - m) - d: z_c - m is exact
near the max, where z_c - lse at large magnitudes would lose 1 - p of confident rows.

The forward reduces a block of classes (a whole row, or a vocabulary tile of it) to
TileStats, its raw sums relative to its own max; merge_tile_stats folds tiles together
and finish_stats turns whole rows' sums into the outputs.
"""

from typing import Callable, NamedTuple

import torch

from ..rowmath.common import all_reduce_sums, first_max, rebased_ez, row_sum, softcapped


class TileStats(NamedTuple):
    """A block of classes' statistics per row, each (n,): m the max of z, s = sum_c
    exp(z_c - m), ez = sum_c exp(z_c - m) (z_c - m) (0 unless the entropy is wanted),
    best the max of softcap(l) and argmax its first class (a whole-vocabulary index),
    z_y the target's z where the target is in the block (else 0)."""
    m: torch.Tensor
    s: torch.Tensor
    ez: torch.Tensor
    best: torch.Tensor
    argmax: torch.Tensor
    z_y: torch.Tensor


def empty_tile_stats(n, dtype, device):
    """The statistics of no classes, to merge tiles into. The float fields are the rows
    of one (5, n) tensor, in the order m, s, ez, best, z_y (the Triton kernel merges
    into it in place)."""
    acc = torch.zeros(5, n, dtype=dtype, device=device)
    m, s, ez, best, z_y = acc
    m.fill_(torch.finfo(dtype).min)  # fills, not a copy from the host: no sync
    best.fill_(float("-inf"))
    return TileStats(m, s, ez, best, torch.zeros(n, dtype=torch.int64, device=device), z_y)


def merge_tile_stats(total, tile):
    """Folds a tile's statistics into the running ones (total, updated in place): s and
    ez rebased to the larger max, the first most likely class kept on ties (a NaN never
    wins), the target's logit from the tile that holds it."""
    m = torch.maximum(total.m, tile.m)
    a, b = torch.exp(total.m - m), torch.exp(tile.m - m)
    total.ez.copy_(a * rebased_ez(total.ez, total.s, total.m, m)
                   + b * rebased_ez(tile.ez, tile.s, tile.m, m))
    total.s.copy_(a * total.s + b * tile.s)
    total.m.copy_(m)
    better = tile.best > total.best
    total.argmax.copy_(torch.where(better, tile.argmax, total.argmax))
    total.best.copy_(torch.where(better, tile.best, total.best))
    total.z_y.add_(tile.z_y)


def finish_stats(stats, target, V, ignore_index, entropy):
    """(logprob, entropy, lse, argmax, row_stats) of whole rows from their TileStats;
    row_stats (n, 3) = (m, log s, d), d = ez / s; entropy zeros unless asked for."""
    log_s = stats.s.log()
    d = stats.ez / stats.s
    lse = stats.m + log_s
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    # A counted target outside [0, V) poisons its row with NaN (as the loss does).
    # (z_y - m) - log s, not z_y - lse: z_y - m is exact near the max, so a confident
    # row keeps its log-prob to float32 precision, where lse's rounding would swamp it.
    logprob = torch.where(valid, torch.where(in_range, (stats.z_y - stats.m) - log_s,
                                             float("nan")), 0.0)
    ent = torch.where(valid, log_s - d, 0.0) if entropy else torch.zeros_like(lse)
    return logprob, ent, lse, stats.argmax, torch.stack([stats.m, log_s, d], 1)


def _tile_stats(z, target, inv_t, entropy, col0):
    """TileStats of softcapped logits z (n, V) of the classes [col0, col0 + V); z is
    scaled by inv_t in place."""
    n, V = z.shape
    best, argmax = first_max(z)  # of softcap(l): the same class as of z for inv_t > 0
    z.mul_(inv_t[:, None])
    col = target - col0
    here = (col >= 0) & (col < V)
    z_y = torch.where(here, z.gather(1, torch.where(here, col, 0).long()[:, None]).squeeze(1),
                      0.0)
    m = z.amax(-1, keepdim=True).clamp_min(torch.finfo(z.dtype).min)
    e = (z - m).exp()
    s = row_sum(e)
    # ez keeps no 0 * -inf at -inf logits and no cancellation against m.
    ez = row_sum(torch.where(e > 0, e * (z - m), 0.0)) if entropy else torch.zeros_like(s)
    return TileStats(m.squeeze(1), s, ez, best, argmax + col0, z_y)


def all_reduce_tile_stats(stats, shard, argmax=True):
    """A vocabulary shard's TileStats made global across the shard group: the max, the
    sums rebased to it, the target logit (held by one rank) and, with argmax (two
    collectives more), the first most likely class (the lowest index among the ranks
    holding the max; else the shard's own, not meant to be read)."""
    M, s, ez, z_y = all_reduce_sums(stats.m, stats.s, stats.ez, shard, stats.z_y)
    if not argmax:
        return TileStats(M, s, ez, stats.best, stats.argmax, z_y)
    best = shard.all_reduce(stats.best, "max")
    idx = torch.where(stats.best == best, stats.argmax, shard.vocab_size)
    return TileStats(M, s, ez, best, shard.all_reduce(idx, "min"), z_y)


def shard_stats(rows, logits, target, inv_t, opts, entropy, math_dtype, shard):
    """rows.stats (a LogProbRows family's) of one chunk, also for a vocabulary shard:
    the shard's TileStats made global across the group, then finished (the argmax is
    then not meant to be read: the losses built on it read none)."""
    if shard.group is None:
        return rows.stats(logits, target, inv_t, opts, entropy, math_dtype)
    part = empty_tile_stats(logits.shape[0], math_dtype, logits.device)
    rows.tile_stats(logits, target, inv_t, opts, entropy, math_dtype, shard.vocab_start, part)
    return finish_stats(all_reduce_tile_stats(part, shard, argmax=False), target,
                        shard.vocab_size, opts.ignore_index, entropy)


class LogProbRows(NamedTuple):
    """The log-probs' row functions on one backend. logits (n, cols) is the loop's
    buffer (overwritten); target holds whole-vocabulary indices; inv_t (n,) is 1/T
    (NaN for a temperature that is not > 0); opts is the op's options record (softcap
    and ignore_index are read).
      stats(logits, target, inv_t, opts, entropy, math_dtype)
          -> (logprob, entropy, lse, argmax, row_stats) of whole rows; row_stats (n, 3)
          = (m, log s, d); entropy (and d) not meant to be read unless asked for
      tile_stats(logits, target, inv_t, opts, entropy, math_dtype, col0, into)
          merges the statistics of the classes [col0, col0 + cols) (a vocabulary tile
          or shard) into the running TileStats `into`
      grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype, col0, dz_dtype)
          -> dz for upstream gradients g_lp, g_h (n,) (g_h None without an entropy
          gradient), from the forward's row statistics; the classes [col0, col0 + cols);
          dz in dz_dtype (the inputs', which float32 logits may be wider than)
      stats_then_grad(logits, target, inv_t, opts, upstream, math_dtype, shard, dz_dtype)
          -> (logprob, entropy, lse, argmax, row_stats, dz): a loss formed in the
          forward: upstream(logprob, entropy) -> (g_lp, g_h) gives the upstream
          gradients from the chunk's statistics (made global across a VocabShard group
          first), dz follows from the same logits (no second GEMM)."""
    stats: Callable
    tile_stats: Callable
    grad: Callable
    stats_then_grad: Callable


def torch_logprob_stats(logits, target, inv_t, opts, entropy, math_dtype):
    """LogProbRows.stats in PyTorch."""
    z, _ = softcapped(logits, opts.softcap, math_dtype)
    stats = _tile_stats(z, target, inv_t, entropy, 0)
    return finish_stats(stats, target, logits.shape[1], opts.ignore_index, entropy)


def torch_logprob_tile_stats(logits, target, inv_t, opts, entropy, math_dtype, col0, into):
    """LogProbRows.tile_stats in PyTorch."""
    z, _ = softcapped(logits, opts.softcap, math_dtype)
    merge_tile_stats(into, _tile_stats(z, target, inv_t, entropy, col0))


def torch_logprob_grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype,
                       col0, dz_dtype):
    """LogProbRows.grad in PyTorch."""
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    z.mul_(inv_t[:, None]).sub_(row_stats[:, :1])  # z - m
    return logits_grad(z, tanh, dz_dtype, target, inv_t, opts, g_lp, g_h, row_stats, col0)


def torch_logprob_stats_then_grad(logits, target, inv_t, opts, upstream, math_dtype, shard,
                                  dz_dtype):
    """LogProbRows.stats_then_grad in PyTorch."""
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    if shard.group is None:
        stats, V = _tile_stats(z, target, inv_t, True, 0), logits.shape[1]
    else:
        V = shard.vocab_size
        stats = all_reduce_tile_stats(_tile_stats(z, target, inv_t, True, shard.vocab_start),
                                      shard, argmax=False)  # the loss reads no argmax
    outputs = finish_stats(stats, target, V, opts.ignore_index, True)
    g_lp, g_h = upstream(outputs[0], outputs[1])
    row_stats = outputs[4]
    z.sub_(row_stats[:, :1])  # z - m
    return (*outputs, logits_grad(z, tanh, dz_dtype, target, inv_t, opts, g_lp, g_h,
                                  row_stats, shard.vocab_start))


def logits_grad(z, tanh, dtype, target, inv_t, opts, g_lp, g_h, row_stats, col0):
    """dz in dtype from z - m (n, cols) of the classes [col0, col0 + cols) (consumed)."""
    V = z.shape[1]
    valid = target != opts.ignore_index
    m, log_s, d = row_stats.unbind(1)
    g = torch.where(valid, g_lp, 0.0)
    p = z.sub(log_s[:, None]).exp_()
    if g_h is None:
        dz = p.mul_(-g[:, None])
    else:
        h = torch.where(valid, g_h, 0.0)
        ent_term = torch.where(p > 0, p * h[:, None] * (z - d[:, None]), 0.0)
        dz = p.mul_(-g[:, None]).sub_(ent_term)
    # A counted target outside the tile adds nothing here (outside [0, V) its outputs
    # are NaN).
    here = (target >= col0) & (target < col0 + V)
    dz.scatter_add_(1, torch.where(here, target - col0, 0).long()[:, None],
                    torch.where(here, g, 0.0)[:, None])
    dz.mul_(inv_t[:, None])
    if tanh is not None:
        dz.mul_(1.0 - tanh * tanh)
    # Ignored rows get exactly 0, whatever their logits (a NaN hidden state).
    dz.masked_fill_((~valid)[:, None], 0.0)
    return dz.to(dtype)


TORCH_LOGPROB_ROWS = LogProbRows(torch_logprob_stats, torch_logprob_tile_stats,
                                 torch_logprob_grad, torch_logprob_stats_then_grad)

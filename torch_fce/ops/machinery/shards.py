"""A vocab-parallel call's VocabShard, after the collective checks that every rank
agrees on the vocabulary's tiling and on the token chunks (before the op, outside
torch.compile): the public vocab-parallel entries (torch_fce.distributed) build theirs
here."""

import torch
import torch.distributed as dist

from ..contract import checks
from ..loop.chunked import VocabShard, chunk_rows_for


def _check_tiling(hidden, weight, target, vocab_start, vocab_size, group):
    """Every rank sees every rank's shard, so all raise the same error (no hang). The
    token chunks too must agree (each chunk's statistics are all-reduced): they depend
    on each process's workspace setting and its GPU's memory."""
    N, D = target.numel(), hidden.shape[-1]
    chunk = chunk_rows_for(hidden.reshape(-1, D), weight,
                           make_shard(vocab_start, vocab_size, group)) if N else 0
    mine = torch.tensor([vocab_start, weight.shape[0], N, D, vocab_size, chunk],
                        dtype=torch.int64, device=hidden.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = sorted(tuple(t.tolist()) for t in everyone)
    if len({r[2:5] for r in rows}) != 1:
        raise ValueError(f"hidden/target/vocab_size differ across ranks: (N, D, V) per "
                         f"rank = {[r[2:5] for r in rows]}")
    if len({r[5] for r in rows}) != 1:
        raise ValueError(f"the ranks cut different token chunks ({sorted({r[5] for r in rows})}"
                         " rows): give every rank the same torch_fce.set_workspace")
    ends = [0] + [start + size for start, size, *_ in rows]
    if [r[0] for r in rows] != ends[:-1] or ends[-1] != vocab_size:
        raise ValueError(f"vocab_start/weight shards do not tile [0, {vocab_size}): "
                         f"(start, rows) per rank = {[r[:2] for r in rows]}")


def checked_shard(hidden, weight, target, vocab_start, vocab_size, group, class_weight=None):
    """The VocabShard of this rank, after the collective checks of the shards and, on the CPU
    or when asked for (a host sync), the kernels check targets and temperatures."""
    group = group or dist.group.WORLD
    if not torch.compiler.is_compiling():
        # before the collective check: every rank raises alike, none waits on another
        checks.check_head_inputs(hidden, weight, target, None, class_weight, vocab_size)
        _check_tiling(hidden, weight, target, vocab_start, vocab_size, group)
    return make_shard(vocab_start, vocab_size, group)


def make_shard(vocab_start, vocab_size, group):
    return VocabShard(group.group_name, vocab_start, vocab_size, dist.get_world_size(group))

"""What a gloo group cannot carry for CUDA tensors, staged through the host: the
functional all-gathers (`_c10d_functional.all_gather_into_tensor`, what
`funcol.all_gather_tensor`, a Shard(0) DTensor's `full_tensor()` and a VocabShard's
`all_gather` run; and its coalesced form).

torch's native functional all-gather calls the group's `allgather_into_tensor_coalesced`,
which ProcessGroupGloo runs as `allgather_coalesced`: that has no CUDA variant (no copy
to pinned host memory, as its allgather, allreduce, broadcast and scatter have), so gloo
reads and writes the CUDA tensors' device pointers on its worker thread: SIGSEGV, no
Python traceback (pytorch/pytorch#152645, open; ProcessGroupGloo.cpp still so in
2026). Its other collectives of CUDA tensors (all_reduce of any dtype, the list
all_gather, all_gather_into_tensor, scatter, reduce_scatter_tensor) stage through the
host themselves and are left to it.

`stage_all_gathers("cuda")` gives both ops a CUDA kernel of their own (before the
C++ one, which is registered for CompositeExplicitAutograd): each input copied to the
host, all-gathered there over the group (`dist.all_gather_into_tensor`, gloo's CPU
path) and copied back. Outputs as the op's: dim 0 times the group's size, rank order.
Process-wide and for the process's life; the ranks of the one-GPU test
(tests/distributed/test_vocab_parallel_one_gpu.py) and of `vocab_parallel_truncation
--one-gpu` install it (the two-GPU NCCL runs do not). The CPU key serves the CPU test of
this staging (tests/distributed/test_gloo_cuda.py)."""

import torch
import torch.distributed as dist

_LIBS = {}


def _group(group_name):
    # the op's schema names the group (str; newer torch may pass the group itself)
    if isinstance(group_name, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group_name)
    return group_name


def _gathered(t, group_size, group):
    host = t.detach().to("cpu").contiguous()
    out = host.new_empty((group_size * host.shape[0], *host.shape[1:]))
    dist.all_gather_into_tensor(out, host, group=group)
    return out.to(t.device)


def _all_gather_into_tensor(input, group_size, group_name):
    return _gathered(input, group_size, _group(group_name))


def _all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    group = _group(group_name)
    return [_gathered(t, group_size, group) for t in inputs]


def stage_all_gathers(device_type="cuda"):
    """Registers the staged all-gathers for device_type's tensors (once a process)."""
    key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
    if key in _LIBS:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _all_gather_into_tensor, key)
    lib.impl("all_gather_into_tensor_coalesced", _all_gather_into_tensor_coalesced, key)
    _LIBS[key] = lib  # the registrations live as long as the Library object

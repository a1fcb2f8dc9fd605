"""The host staging of the functional all-gathers (torch_fce/bench/gloo_cuda.py, what the one-GPU test's
ranks install for CUDA tensors) here on the CPU key, two gloo ranks: every caller the
vocab-parallel checks have (funcol, a DTensor's full_tensor, a VocabShard's all_gather,
the vocab-parallel top-k) goes through it and gets what torch's own kernel gives."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

import torch_fce
from torch_fce.distributed import vocab_parallel_linear_topk_logprobs
from torch_fce.ops.machinery.shards import make_shard
from torch_fce.testing import make_inputs
from torch_fce.bench import gloo_cuda

V = 37


def _worker(rank, world, path):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        mine = {torch.float32: torch.arange(6.0).reshape(3, 2) + 10 * rank,
                torch.bfloat16: (torch.arange(4.0) + rank).to(torch.bfloat16),
                torch.int64: torch.arange(5)[None] * (rank + 1)}
        native = {d: funcol.all_gather_tensor(t, 0, group).wait() for d, t in mine.items()}
        assert torch.equal(native[torch.int64], torch.stack([torch.arange(5) * (r + 1)
                                                            for r in range(world)]))
        coalesced = [funcol.wait_tensor(t) for t in
                     torch.ops._c10d_functional.all_gather_into_tensor_coalesced(
                         list(mine.values()), world, group.group_name)]
        w = torch.randn(V, 8, generator=torch.Generator().manual_seed(1))
        mesh = init_device_mesh("cpu", (world,))
        full_native = distribute_tensor(w, mesh, [Shard(0)]).full_tensor()

        calls = []
        gathered = gloo_cuda._gathered
        gloo_cuda._gathered = lambda *a: calls.append(a[0].dtype) or gathered(*a)
        gloo_cuda.stage_all_gathers("cpu")
        gloo_cuda.stage_all_gathers("cpu")  # once a process
        for d, t in mine.items():
            got = funcol.all_gather_tensor(t, 0, group)
            got = got.wait() if isinstance(got, funcol.AsyncCollectiveTensor) else got
            assert got.dtype == d and torch.equal(got, native[d]), d
        staged = torch.ops._c10d_functional.all_gather_into_tensor_coalesced(
            list(mine.values()), world, group.group_name)
        assert all(torch.equal(funcol.wait_tensor(a), b) for a, b in zip(staged, coalesced))
        assert calls == 2 * list(mine), calls
        assert torch.equal(distribute_tensor(w, mesh, [Shard(0)]).full_tensor(), full_native)
        assert torch.equal(full_native, w)
        shard = make_shard(0, V, group)
        assert torch.equal(shard.all_gather(mine[torch.int64]), native[torch.int64])
        n = len(calls)

        x = make_inputs(16, 8, V, bias=True, seed=23)
        bounds = [0, 15, V]
        start, end = bounds[rank], bounds[rank + 1]
        want = torch_fce.linear_topk_logprobs(x["hidden"], x["weight"], 6, x["bias"])
        got = vocab_parallel_linear_topk_logprobs(
            x["hidden"], x["weight"][start:end], 6, x["bias"][start:end], vocab_start=start,
            vocab_size=V)
        assert len(calls) > n  # the top-k's merge gathered through the staging
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.logprobs, want.logprobs)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as test_vocab_parallel.py's ranks: no C++ static destructors


def test_staged_all_gathers_equal_torchs_own():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

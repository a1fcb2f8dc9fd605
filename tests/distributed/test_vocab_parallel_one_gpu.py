"""Every vocab-parallel family on one GPU's own kernels: two processes share cuda:0,
each holding a shard of the head, over a gloo group of CUDA tensors (NCCL refuses two
ranks on one GPU), at a real size, against one process on the same GPU
(shards_on_gpus.py, the body the two-GPU NCCL test runs too). What gloo cannot carry
for CUDA tensors is named in its test."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.shards_on_gpus import check_every_family

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _worker(rank, world, path):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        check_every_family(rank, world)
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_one_gpu_match_one_process():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

"""Vocab-parallel losses on two GPUs over NCCL equal the single-GPU ops, at a real size,
every family on the GPU's kernels (shards_on_gpus.py: the body the one-GPU test runs
over gloo too).

Needs two CUDA GPUs (skipped otherwise); NVLink multicast is kept off.
"""

import faulthandler
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.shards_on_gpus import check_every_family


def _worker(rank, world, path):
    faulthandler.enable(all_threads=True)  # a crashed rank's Python stacks
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        check_every_family(rank, world)
    finally:
        dist.destroy_process_group()
    # Passed: leave without C++ static destructors (as test_vocab_parallel.py's ranks)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_vocab_parallel_nccl_matches_single_gpu(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

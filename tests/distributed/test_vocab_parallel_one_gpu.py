"""Every vocab-parallel family on one GPU's own kernels: two processes share cuda:0,
each holding a shard of the head, over a gloo group of CUDA tensors (NCCL refuses two
ranks on one GPU), at a real size, against one process on the same GPU
(shards_on_gpus.py, the body the two-GPU NCCL test runs too). What gloo cannot carry
for CUDA tensors, its functional all-gathers (a SIGSEGV on its worker thread), the
ranks stage through the host (torch_fce/bench/gloo_cuda.py); its other collectives of CUDA tensors
stage themselves. A rank that crashes all the same prints every thread's Python stack
(faulthandler)."""

import faulthandler
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_fce.bench.gloo_cuda import stage_all_gathers
from tests.distributed.shards_on_gpus import check_every_family

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _worker(rank, world, path):
    faulthandler.enable(all_threads=True)
    torch.cuda.set_device(0)
    stage_all_gathers("cuda")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        check_every_family(rank, world)
    finally:
        dist.destroy_process_group()
    # Passed: leave without C++ static destructors (test_vocab_parallel.py's ranks: a
    # torch thread still joinable at exit can abort a process after every check passed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_ranks_on_one_gpu_match_one_process():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

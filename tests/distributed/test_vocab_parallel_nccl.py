"""Vocab-parallel loss on two GPUs over NCCL equals the single-GPU op, at a real size.

Needs two CUDA GPUs (skipped otherwise); NVLink multicast is kept off.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_fce
from torch_fce.distributed import vocab_parallel_linear_cross_entropy
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import LOSS_TOL, grad_tol

N, D, V = 8192, 2048, 128256
FAMILIES = [
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.bfloat16, bias=True, class_weight=True, label_smoothing=0.1,
         softcap=30.0, z_loss=1e-4),
    dict(dtype=torch.bfloat16, accumulator="kahan", reduction="sum"),
    dict(dtype=torch.float32, reduction="none", label_smoothing=0.1),
]


def _worker(rank, world, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        bounds = [V * r // world for r in range(world + 1)]
        start, end = bounds[rank], bounds[rank + 1]
        for family in FAMILIES:
            family = dict(family)
            dtype = family.pop("dtype")
            x = make_inputs(N, D, V, dtype, bias=family.pop("bias", False),
                            class_weight=family.pop("class_weight", False), device="cuda",
                            seed=3)
            g = torch.randn(N if family.get("reduction") == "none" else (),
                            generator=torch.Generator().manual_seed(1)).cuda()
            full = {k: x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")
                    if x[k] is not None}
            ref = torch_fce.linear_cross_entropy(**{**x, **full}, **family)
            ref_grads = torch.autograd.grad(ref, list(full.values()), g)
            mine = {k: (v if k == "hidden" else v[start:end]).detach().clone()
                    .requires_grad_() for k, v in full.items()}
            loss = vocab_parallel_linear_cross_entropy(
                mine["hidden"], mine["weight"], x["target"], mine.get("bias"),
                x["class_weight"], vocab_start=start, vocab_size=V, **family)
            grads = torch.autograd.grad(loss, list(mine.values()), g)
            assert rel_err(loss, ref) <= LOSS_TOL, family
            tol = grad_tol(dtype, N)
            for name, got, want in zip(mine, grads, ref_grads):
                want = want if name == "hidden" else want[start:end]
                assert rel_err(got, want) <= tol, (family, name, rel_err(got, want))
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_vocab_parallel_nccl_matches_single_gpu(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

"""Vocab-parallel losses on two GPUs over NCCL equal the single-GPU ops, at a real size
(the cross entropy; the top-k and the sparse divergence on their Triton kernels).

Needs two CUDA GPUs (skipped otherwise); NVLink multicast is kept off.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_fce
from torch_fce.distributed import (vocab_parallel_linear_cross_entropy,
                                   vocab_parallel_linear_sparse_divergence,
                                   vocab_parallel_linear_topk_logprobs)
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
        _check_topk_distillation(start, end)
    finally:
        dist.destroy_process_group()


def _check_topk_distillation(start, end):
    # the teacher's top-k and the student's sparse divergence (tail on and off) on their
    # Triton kernels per shard, against one GPU: the same classes in the same order where
    # the logits agree (shard and whole GEMMs may round a logit apart), the log-probs,
    # the loss and the gradients
    x = make_inputs(N // 4, D, V, torch.bfloat16, bias=True, device="cuda", seed=5)
    h, w, b = x["hidden"], x["weight"], x["bias"]
    want = torch_fce.linear_topk_logprobs(h, w, 16, b, target=x["target"], temperature=0.9)
    got = vocab_parallel_linear_topk_logprobs(h, w[start:end], 16, b[start:end],
                                              vocab_start=start, vocab_size=V,
                                              target=x["target"], temperature=0.9)
    assert (got.indices == want.indices).all(-1).float().mean() >= 0.99
    assert rel_err(got.logprobs, want.logprobs) <= LOSS_TOL
    assert rel_err(got.target_logprob, want.target_logprob) <= LOSS_TOL
    support, teacher = want.indices, want.logprobs - 0.05  # a teacher near the student
    for opts in (dict(beta=0.0, tail=True), dict(beta=0.5, tail=False, softcap=30.0)):
        full = [t.clone().requires_grad_() for t in (h, w, b)]
        ref, _ = torch_fce.linear_sparse_divergence(full[0], full[1], support, teacher,
                                                    full[2], **opts)
        ref_grads = torch.autograd.grad(ref, full)
        mine = [t.clone().requires_grad_() for t in (h, w[start:end], b[start:end])]
        loss, _ = vocab_parallel_linear_sparse_divergence(
            mine[0], mine[1], support, teacher, mine[2], vocab_start=start, vocab_size=V,
            **opts)
        grads = torch.autograd.grad(loss, mine)
        assert rel_err(loss, ref) <= LOSS_TOL, opts
        tol = grad_tol(torch.bfloat16, N)
        for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
            r = r if name == "hidden" else r[start:end]
            assert rel_err(g, r) <= tol, (opts, name, rel_err(g, r))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_vocab_parallel_nccl_matches_single_gpu(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)

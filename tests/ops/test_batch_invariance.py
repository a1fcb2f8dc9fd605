"""Batch invariance: a token's per-token outputs are bitwise the same whatever batch it
is computed in (sizes 1 to N, its position, the workspace), for every op family, with
bf16 and float32 logits, the log-probs also under the sampler's truncation (its top-k
candidates, and its threshold sweeps on CUDA), on the CPU and (the GPU tier) on CUDA.
More classes than the one-row sum threshold (V > 32768) and fewer tokens than classes
(the log-probs' vocabulary tiles); a 4 MiB workspace cuts the whole batch into 5-10
chunks (a smaller one only adds chunks: the CPU suite's time)."""

import pytest
import torch

import torch_fce

from tests.helpers import DEVICE

N, D, V = 320, 64, 33001
BATCHES = ((0, 1), (5, 6), (0, 7), (100, 164), (0, 257), (160, 320))


def _rows_differing(a, b):
    a, b = (x.view(torch.int32) if x.dtype == torch.float32 else x for x in (a, b))
    return int((a != b).reshape(a.shape[0], -1).any(1).sum())


@pytest.fixture(scope="module")
def heads():
    g = torch.Generator().manual_seed(0)
    return [x.to(DEVICE) for x in (
        torch.randn(N, D, generator=g).bfloat16(), (torch.randn(V, D, generator=g) / 4).bfloat16(),
        torch.randint(0, V, (N,), generator=g), torch.randn(N, 48, generator=g).bfloat16(),
        (torch.randn(V, 48, generator=g) / 4).bfloat16())]


def _ops(h, w, t, ht, wt, ldt):
    old = torch.zeros(N, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    sup = torch.randint(0, V, (N, 8), generator=g).to(DEVICE)
    lp = torch.randn(N, 8, generator=g).log_softmax(-1).to(DEVICE)
    return {
        "logprobs": lambda s, e: torch.stack(torch_fce.linear_logprobs(
            h[s:e], w, t[s:e], temperature=0.7, entropy=True, logits_dtype=ldt)[:3], 1),
        "log-probs, top_k and top_p": lambda s, e: torch.stack(torch_fce.linear_logprobs(
            h[s:e], w, t[s:e], temperature=0.7, entropy=True, logits_dtype=ldt, top_k=50,
            top_p=0.9)[:3], 1),
        "log-probs, top_p and min_p": lambda s, e: torch.stack(torch_fce.linear_logprobs(
            h[s:e], w, t[s:e], temperature=0.7, entropy=True, logits_dtype=ldt, top_p=0.9,
            min_p=0.001)[:3], 1),
        "cross entropy": lambda s, e: torch_fce.linear_cross_entropy(
            h[s:e], w, t[s:e], reduction="none", label_smoothing=0.1,
            logits_dtype=ldt).float()[:, None],
        "policy": lambda s, e: torch.stack(torch_fce.linear_policy_loss(
            h[s:e], w, t[s:e], torch.ones(e - s, device=DEVICE), old_logprobs=old[s:e],
            ref_logprobs=old[s:e], beta=0.04, logits_dtype=ldt)[1][:2], 1),
        "distillation": lambda s, e: torch.stack(torch_fce.linear_distillation_loss(
            h[s:e], w, ht[s:e], wt, t[s:e], beta=0.5, logits_dtype=ldt)[1], 1),
        "sparse divergence": lambda s, e: torch.stack(torch_fce.linear_sparse_divergence(
            h[s:e], w, sup[s:e], lp[s:e], beta=0.5, tail=True, logits_dtype=ldt)[1], 1),
        "top-k": lambda s, e: torch.cat([
            (top := torch_fce.linear_topk_logprobs(h[s:e], w, 8, target=t[s:e],
                                                   logits_dtype=ldt)).logprobs,
            top.target_logprob[:, None]], 1),
    }


@pytest.mark.parametrize("ldt", [None, torch.float32])
def test_every_op_bitwise_in_any_batch_and_workspace(heads, ldt):
    for name, op in _ops(*heads, ldt).items():
        whole = op(0, N)
        for s, e in BATCHES:
            assert _rows_differing(op(s, e), whole[s:e]) == 0, (name, s, e)
        with torch_fce.workspace(4 * 2 ** 20):
            assert _rows_differing(op(0, N), whole) == 0, (name, "4 MiB workspace")

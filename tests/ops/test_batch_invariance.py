"""Batch invariance on CUDA: a token's per-token outputs are bitwise the same whatever
batch it is computed in (sizes 1 to N, its position, the workspace). The log-probs'
forward runs token chunks only; the logits GEMMs are row-invariant on the H200 (docs/
api.md). CPU GEMMs are not (their row results depend on the row count): not yet."""

import pytest
import torch

import torch_fce

pytestmark = pytest.mark.cuda


def _rows_differing(a, b):
    return int((a.view(torch.int32) != b.view(torch.int32)).reshape(a.shape[0], -1)
               .any(1).sum())


@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_logprobs_bitwise_in_any_batch(logits_dtype):
    g = torch.Generator().manual_seed(0)
    N, D, V = 2048, 256, 32003  # fewer tokens than classes in every batch
    h = torch.randn(N, D, generator=g).bfloat16().cuda()
    w = (torch.randn(V, D, generator=g) / D ** 0.5 * 2).bfloat16().cuda()
    t = torch.randint(0, V, (N,), generator=g).cuda()
    T = torch.full((N,), 0.7, device="cuda")

    def run(s, e):
        out = torch_fce.linear_logprobs(h[s:e], w, t[s:e], temperature=T[s:e], entropy=True,
                                        logits_dtype=logits_dtype)
        return torch.stack([out.logprob, out.entropy, out.lse], 1)

    whole = run(0, N)
    for s, e in ((0, 1), (5, 6), (0, 64), (100, 357), (1000, 2000), (N - 999, N)):
        assert _rows_differing(run(s, e), whole[s:e]) == 0, (s, e)
    for mib in (1, 16):
        with torch_fce.workspace(mib * 2 ** 20):
            assert _rows_differing(run(0, N), whole) == 0, mib

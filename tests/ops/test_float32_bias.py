"""A float32 head bias beside bfloat16 hidden states and weight (a master bias under
mixed precision) on every op: accepted, its gradient float32, and added as TRL's heads
add it: unrounded to float32 logits (logits_dtype=torch.float32), rounded to bfloat16
with bfloat16 logits (the same values as passing bias.bfloat16())."""

import pytest
import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, D, V = 10, 16, 37


def _inputs():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, D, generator=g).bfloat16()
    w = torch.randn(V, D, generator=g).bfloat16()
    # values bf16 cannot hold: rounding the bias would show
    b = torch.randn(V, generator=g) * 3 + 1 / 3
    t = torch.randint(0, V, (N,), generator=g)
    t[2] = -100
    ht, wt = torch.randn(N, 8, generator=g).bfloat16(), torch.randn(V, 8, generator=g).bfloat16()
    idx, p = torch.randint(0, V, (N, 3), generator=g), torch.rand(N, 3, generator=g)
    adv = torch.randn(N, generator=g)
    return {k: v.to(DEVICE) for k, v in dict(h=h, w=w, b=b, t=t, ht=ht, wt=wt, idx=idx, p=p,
                                               adv=adv).items()}


def _ops(x):
    """name -> fn(h, w, b, logits_dtype) of a scalar; with logits_dtype "exact", the
    float64 composition with logits F.linear(h, w) + b."""
    valid = x["t"] != -100

    def z(h, w, b):
        return F.linear(h.double(), w.double()) + b.double()

    def ce(h, w, b, ld):
        if ld == "exact":
            return F.cross_entropy(z(h, w, b), x["t"])
        return torch_fce.linear_cross_entropy(h, w, x["t"], b, logits_dtype=ld)

    def logprobs(h, w, b, ld):
        if ld == "exact":
            lp = z(h, w, b).log_softmax(-1).gather(-1, x["t"].clamp(min=0)[:, None])[:, 0]
            return torch.where(valid, lp, 0.0).sum()
        return torch_fce.linear_logprobs(h, w, x["t"], b, logits_dtype=ld).logprob.sum()

    def policy(h, w, b, ld):
        if ld == "exact":
            lp = z(h, w, b).log_softmax(-1).gather(-1, x["t"].clamp(min=0)[:, None])[:, 0]
            return torch.where(valid, -x["adv"] * torch.exp(lp - lp.detach()), 0.0).sum() \
                / valid.sum()
        return torch_fce.linear_policy_loss(h, w, x["t"], x["adv"], b, loss_type="reinforce",
                                            logits_dtype=ld)[0]

    def distill(h, w, b, ld):
        teacher_b = b.detach() * 0.5  # no gradient reaches the teacher
        if ld == "exact":
            lq = z(h, w, b).log_softmax(-1)
            lp = z(x["ht"], x["wt"], teacher_b).log_softmax(-1)
            return (lp.exp() * (lp - lq)).sum(-1).mean()
        return torch_fce.linear_distillation_loss(h, w, x["ht"], x["wt"], bias=b,
                                                  teacher_bias=teacher_b,
                                                  logits_dtype=ld)[0]

    def soft_ce(h, w, b, ld):
        if ld == "exact":
            return -(x["p"] * z(h, w, b).log_softmax(-1).gather(-1, x["idx"])).sum(-1).mean()
        return torch_fce.linear_soft_cross_entropy(h, w, x["idx"], x["p"], b, logits_dtype=ld)

    return dict(ce=ce, logprobs=logprobs, policy=policy, distill=distill, soft_ce=soft_ce)


def _run(fn, h, w, b, ld):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    loss = fn(*leaves, ld)
    return [loss.detach()] + list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("name", ["ce", "logprobs", "policy", "distill", "soft_ce"])
def test_a_float32_bias_beside_bfloat16_heads(name):
    x = _inputs()
    fn = _ops(x)[name]
    h, w, b = x["h"], x["w"], x["b"]
    truth = _run(fn, h, w, b, "exact")
    wide = _run(fn, h, w, b, torch.float32)
    assert wide[3].dtype == torch.float32  # the bias's gradient, in its dtype
    for what, a, r in zip(("loss", "hidden", "weight", "bias"), wide, truth):
        bar = 1e-5 if what == "loss" else 2 ** -7  # dz rounded once to bf16
        assert rel_err(a.double(), r) <= bar, what
    # bf16 logits: the bias rounded to bf16 first, as TRL's log-prob head adds it
    rounded = _run(fn, h, w, b, None)
    as_bf16 = _run(fn, h, w, b.bfloat16().float(), None)
    for a, c in zip(rounded, as_bf16):
        assert torch.equal(a, c)

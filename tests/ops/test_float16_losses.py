"""float16 on the scalar losses whose forward forms their gradients (policy loss,
distillation, sparse-target cross entropy): accepted, and a GradScaler's scale reaches
the logits gradient before it is rounded to float16, as it reaches torch's. Token
weights small enough that a unit-gradient float16 dz would underflow to 0; against the
float64 composition from the same float16 values, the bound the bfloat16 tests use
for one rounding of the gradient (a few float16 epsilons); on both row backends, eager
and compiled."""

import pytest
import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.ops.machinery import dispatch
from torch_fce.testing import rel_err

from ..helpers import EPS
from tests.helpers import BACKENDS, chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 2.0 ** 16  # a GradScaler's initial scale
N, D, V = 24, 16, 53


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.1
    ht, wt = torch.randn(N, 8, generator=g), torch.randn(V, 8, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    idx = torch.randint(0, V, (N, 4), generator=g)
    p = torch.rand(N, 4, generator=g)
    adv = torch.randn(N, generator=g)
    # w_t * p_v (p - q) ~ 1e-9 per logit: below float16's smallest subnormal (6e-8)
    weights = torch.full((N,), 1e-6)
    return {k: v.to(DEVICE) for k, v in dict(h=h, w=w, b=b, ht=ht, wt=wt, t=t, idx=idx, p=p,
                                               adv=adv, weights=weights).items()}


def _losses(x):
    """name -> (torch_fce's loss of (h, w, b), the float64 composition of (h, w, b))."""
    valid = x["t"] != -100

    def logp(h, w, b):
        return F.linear(h, w, b).double().log_softmax(-1)

    def distill(h, w, b, ours=True):
        if ours:
            return torch_fce.linear_distillation_loss(
                h, w, x["ht"].half(), x["wt"].half(), beta=0.5, bias=b,
                token_weights=x["weights"])[0]
        lq = logp(h, w, b)
        lp = F.linear(x["ht"].half().double(), x["wt"].half().double()).log_softmax(-1)
        lm = torch.logsumexp(torch.stack([lq + torch.log(torch.tensor(0.5)),
                                          lp + torch.log(torch.tensor(0.5))]), 0)
        div = 0.5 * (lp.exp() * (lp - lm)).sum(-1) + 0.5 * (lq.exp() * (lq - lm)).sum(-1)
        return (x["weights"].double() * div).sum()

    def soft_ce(h, w, b, ours=True):
        if ours:
            return torch_fce.linear_soft_cross_entropy(h, w, x["idx"], x["p"], b,
                                                       token_weights=x["weights"])
        per = -(x["p"].double() * logp(h, w, b).gather(-1, x["idx"])).sum(-1)
        return (x["weights"].double() * per).sum()

    def policy(h, w, b, ours=True):
        if ours:
            return torch_fce.linear_policy_loss(h, w, x["t"], x["adv"], b, loss_type="reinforce", logits_dtype=torch.float32,
                                                token_weights=x["weights"])[0]
        lp = logp(h, w, b).gather(-1, x["t"].clamp(min=0)[:, None])[:, 0]
        per = -x["adv"].double() * torch.exp(lp - lp.detach())  # -r A, old = lp
        return torch.where(valid, x["weights"].double() * per, 0.0).sum()

    return dict(distill=distill, soft_ce=soft_ce, policy=policy)


def _grads(fn, leaves, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    loss = fn(*leaves, **kw)
    return [loss.detach()] + list(torch.autograd.grad(loss * SCALE, leaves))


@pytest.mark.parametrize("backend", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("name", ["distill", "soft_ce", "policy"])
def test_float16_gradients_take_the_scale_before_rounding(monkeypatch, backend, name):
    monkeypatch.setattr(dispatch, "backend_for", lambda hidden: BACKENDS[backend])
    x = _inputs()
    fn = _losses(x)[name]
    h, w, b = (x[k].half() for k in ("h", "w", "b"))
    truth = _grads(lambda *a: fn(*(t.double() for t in a), ours=False), (h, w, b))
    with chunks(8, h, w):  # several chunks
        ours = _grads(fn, (h, w, b))
    assert [g.dtype for g in ours[1:]] == [torch.float16] * 3
    assert rel_err(ours[0].double(), truth[0]) <= 1e-5, "loss"
    for what, a, r in zip(("hidden", "weight", "bias"), ours[1:], truth[1:]):
        assert a.abs().max() > 0, what  # nothing underflowed to 0
        assert rel_err(a.double(), r) <= 4 * EPS[torch.float16], what


def test_float16_gradients_compiled_equal_eager():
    x = _inputs(1)
    fn = _losses(x)["distill"]
    h, w, b = (x[k].half() for k in ("h", "w", "b"))
    eager = _grads(fn, (h, w, b))
    compiled = _grads(torch.compile(fn, fullgraph=True, dynamic=True), (h, w, b))
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)

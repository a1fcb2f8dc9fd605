"""dft=True (Dynamic Fine-Tuning, TRL's SFT loss_type="dft") against a float64
composition from the logits: each token's w_y * nll times its detached p(target), every
reduction, softcap, class weights, bias, confident rows at large magnitudes; through the
op (autograd, both the forward-formed and the recomputed gradient), the PyTorch rows and
the Triton rows on the loop; compile; the refusals."""

import pytest
import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.ops import linear_ce
from torch_fce.ops.linear_ce import CEOptions
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import confident_inputs

from tests.helpers import BACKENDS, ONE_DEVICE, chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-5  # float32 row math and sums against float64, float32 inputs


def dft_reference(hidden, weight, target, bias, class_weight, reduction, softcap, grad_out,
                  dft=True):
    """float64 (loss, {hidden, weight, bias} gradients for grad_out) from the logits
    (dft=False: the plain cross entropy)."""
    leaves = {"hidden": hidden.double().requires_grad_(),
              "weight": weight.double().requires_grad_()}
    if bias is not None:
        leaves["bias"] = bias.double().requires_grad_()
    z = F.linear(leaves["hidden"], leaves["weight"], leaves.get("bias"))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = target != -100
    safe = torch.where(valid, target, 0)
    logp_y = z.log_softmax(-1).gather(-1, safe[:, None]).squeeze(-1)
    w_y = torch.ones_like(logp_y) if class_weight is None else class_weight.double()[safe]
    w_y = torch.where(valid, w_y, 0.0)
    per_token = -logp_y * (logp_y.exp().detach() if dft else 1.0) * w_y
    loss = {"none": per_token, "sum": per_token.sum(),
            "mean": per_token.sum() / w_y.sum()}[reduction]
    grads = torch.autograd.grad(loss, list(leaves.values()), grad_out.double())
    return loss.detach(), dict(zip(leaves, grads))


def _inputs(kind, bias, class_weight):
    if kind == "confident":  # lse about 70, most rows with p(target) > 0.98
        h, w, t = confident_inputs(40, 24, 257)
        t[::7] = -100
        x = dict(hidden=h, weight=w, target=t, bias=None, class_weight=None)
        if bias:
            x["bias"] = torch.randn(257, generator=torch.Generator().manual_seed(3))
        if class_weight:
            x["class_weight"] = torch.rand(257, generator=torch.Generator().manual_seed(4))
        return x
    return make_inputs(24, 16, 37, bias=bias, class_weight=class_weight, ignore_frac=0.2,
                       weight_scale=2.0)


def _grad_out(reduction, N):
    if reduction == "none":
        return torch.randn(N, generator=torch.Generator().manual_seed(5))
    return torch.tensor(1.7)


@pytest.mark.parametrize("backend", ["op", "torch_rows", "triton_rows"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind, softcap, bias, class_weight", [
    ("random", None, False, False), ("random", 5.0, True, True),
    ("confident", None, False, False), ("confident", 150.0, True, True)])
def test_dft_matches_float64(backend, reduction, kind, softcap, bias, class_weight):
    x = {k: None if v is None else v.to(DEVICE) for k, v in
         _inputs(kind, bias, class_weight).items()}
    g = _grad_out(reduction, x["target"].numel()).to(DEVICE)
    ref_loss, ref = dft_reference(**x, reduction=reduction, softcap=softcap, grad_out=g)
    if backend == "op":
        leaves = {k: x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")
                  if x[k] is not None}
        loss = torch_fce.linear_cross_entropy(
            leaves["hidden"], leaves["weight"], x["target"], leaves.get("bias"),
            x["class_weight"], reduction=reduction, softcap=softcap, dft=True)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), g)))
    else:
        args = (x["hidden"], x["weight"], x["target"], x["bias"], x["class_weight"])
        opts = CEOptions(reduction=reduction, softcap=softcap, dft=True)
        needs = [True, True, bias]
        with chunks(5, x["hidden"], x["weight"]):  # several chunks
            if reduction == "none":
                loss = linear_ce.fwd(*args, *opts, *ONE_DEVICE, [False] * 3, False,
                                     backend=BACKENDS[backend])[0]
                out = linear_ce.bwd(g, *args, *opts, *ONE_DEVICE, needs,
                                    backend=BACKENDS[backend])
            else:
                loss, *out, _, _, _ = linear_ce.fwd(*args, *opts, *ONE_DEVICE, needs, False,
                                                    backend=BACKENDS[backend])
                out = [o * g for o in out]
        grads = dict(zip(("hidden", "weight", "bias")[:2 + bias], out))
    assert rel_err(loss.detach(), ref_loss) <= TOL
    for name, grad in grads.items():
        assert rel_err(grad, ref[name]) <= TOL, name


def test_dft_is_not_the_plain_loss_and_its_stats_are_the_plain_ones():
    x = make_inputs(24, 16, 37, ignore_frac=0.2, weight_scale=2.0)
    args = (x["hidden"], x["weight"], x["target"])
    dft, stats = torch_fce.linear_cross_entropy(*args, dft=True, return_stats=True)
    plain, plain_stats = torch_fce.linear_cross_entropy(*args, return_stats=True)
    assert 0.0 < dft < plain
    for a, b in zip(stats, plain_stats):  # lse, argmax, entropy: the logits' own
        assert torch.equal(a, b)


def test_dft_compiles_fullgraph_dynamic_and_module():
    x = make_inputs(24, 16, 37, ignore_frac=0.2)
    fn = torch.compile(lambda h, w, t: torch_fce.linear_cross_entropy(h, w, t, dft=True),
                       fullgraph=True, dynamic=True)
    assert torch.allclose(fn(x["hidden"], x["weight"], x["target"]),
                          torch_fce.linear_cross_entropy(x["hidden"], x["weight"],
                                                         x["target"], dft=True))
    module = torch_fce.LinearCrossEntropyLoss(dft=True, reduction="sum")
    assert "dft=True" in repr(module)
    assert torch.equal(module(x["hidden"], x["weight"], x["target"]),
                       torch_fce.linear_cross_entropy(x["hidden"], x["weight"], x["target"],
                                                      dft=True, reduction="sum"))


@pytest.mark.parametrize("options, error, text", [
    (dict(dft=1), TypeError, "dft must be a bool"),
    (dict(dft=True, label_smoothing=0.1), ValueError, "dft=True"),
    (dict(dft=True, z_loss=1e-4), ValueError, "dft=True"),
])
def test_dft_bad_options_named(options, error, text):
    x = make_inputs(4, 8, 11)
    with pytest.raises(error, match=text):
        torch_fce.linear_cross_entropy(x["hidden"], x["weight"], x["target"], **options)
    with pytest.raises(error, match=text):
        torch_fce.LinearCrossEntropyLoss(**options)


@pytest.mark.parametrize("backend", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("dft", [False, True])
def test_confident_rows_keep_float32_precision(backend, dft):
    # lse about 70: the rows form log p_y and p as (z - m) - log s, so the loss and the
    # gradients of confident rows (p_y - 1 of 1e-3..1e-2) stay within twice torch's
    # float32 composition's error from float64; exp(z - lse) carried lse's rounding
    # (the Triton rows' hidden gradient 3.3e-5 of plain CE, 10x torch's, before).
    x = {k: None if v is None else v.to(DEVICE) for k, v in
         _inputs("confident", False, False).items()}
    g = torch.tensor(1.0, device=DEVICE)
    ref_loss, ref = dft_reference(**x, reduction="sum", softcap=None, grad_out=g, dft=dft)
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    valid = x["target"] != -100
    logp = F.linear(h, w).log_softmax(-1).gather(-1, x["target"].clamp(min=0)[:, None])[:, 0]
    per = -logp * (logp.exp().detach() if dft else 1.0)
    torch_loss = torch.where(valid, per, 0.0).sum()
    torch_grads = torch.autograd.grad(torch_loss, (h, w))
    args = (x["hidden"], x["weight"], x["target"], None, None)
    with chunks(5, x["hidden"], x["weight"]):
        loss, gh, gw, _, _, _, _ = linear_ce.fwd(
            *args, *CEOptions(reduction="sum", dft=dft), *ONE_DEVICE, [True, True, False],
            False, backend=BACKENDS[backend])
    assert rel_err(loss, ref_loss) <= 2 * rel_err(torch_loss.detach(), ref_loss) + 1e-7
    for got, want, theirs in zip((gh, gw), (ref["hidden"], ref["weight"]), torch_grads):
        assert rel_err(got, want) <= 2 * rel_err(theirs, want) + 1e-7

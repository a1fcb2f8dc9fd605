"""Autograd contract: non-terminal losses, retain_graph, partial grads, no extra work."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_fce
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import LOSS_TOL, grad_tol, reference_loss_and_grads


def _leaves(x, names=("hidden", "weight", "bias")):
    return {k: x[k].requires_grad_() for k in names if x[k] is not None}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_ce_scaled_reused_and_retained(reduction):
    x = make_inputs(12, 5, 13, bias=True)
    leaves = _leaves(x)
    loss = torch_fce.linear_cross_entropy(**x, reduction=reduction, z_loss=1e-2)
    total = (loss * 3.0).sum() + loss.sum() * -0.5  # upstream gradient 2.5, loss used twice
    total.backward(retain_graph=True)
    total.backward()  # a second pass through the same saved state accumulates again
    _, ref = reference_loss_and_grads(**x, grad_out=torch.full(loss.shape, 5.0),
                                      reduction=reduction, z_loss=1e-2)
    for k, v in leaves.items():
        assert rel_err(v.grad, ref[k]) <= grad_tol(torch.float32, 13), k


def test_linear_ce_only_requested_grads():
    x = make_inputs(8, 4, 7, bias=True)
    w = x["weight"].requires_grad_()
    torch_fce.linear_cross_entropy(**x).backward()
    assert x["hidden"].grad is None and x["bias"].grad is None and w.grad is not None


def _count_matmuls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("aten::mm", "aten::addmm") for e in prof.events())


def test_linear_ce_inference_does_no_gradient_work():
    x = make_inputs(8, 4, 7)
    x["hidden"].requires_grad_()
    with torch.no_grad():
        assert _count_matmuls(lambda: torch_fce.linear_cross_entropy(**x)) == 1  # logits
    # With grad: logits + hidden gradient, both in the forward; the backward only scales.
    assert _count_matmuls(lambda: torch_fce.linear_cross_entropy(**x)) == 2


def test_linear_ce_double_backward_raises_clearly():
    x = make_inputs(6, 3, 5)
    h = x["hidden"].requires_grad_()
    (gh,) = torch.autograd.grad(torch_fce.linear_cross_entropy(**x), h, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gh.sum().backward()


def test_linear_ce_master_weights_and_autocast():
    x = make_inputs(16, 8, 11, torch.float32, bias=True)
    leaves = _leaves(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch_fce.linear_cross_entropy(**x)
    loss.backward()
    assert loss.dtype == torch.float32 and x["weight"].grad.dtype == torch.float32
    # Autocast semantics: products in bfloat16, the rest as the reference.
    cast = {**x, "hidden": x["hidden"].detach().bfloat16(),
            "bias": x["bias"].detach(), "weight": x["weight"].detach()}
    ref_loss, ref = reference_loss_and_grads(**cast)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    for k, v in leaves.items():
        assert rel_err(v.grad, ref[k]) <= grad_tol(torch.bfloat16, 16), k


def test_linear_ce_autocast_accepts_what_f_linear_accepts():
    # Under autocast F.linear takes a float32 input with a bf16 weight, and a float32 bias
    # with bf16 weights; all are cast to bf16 for the product. So does the op.
    x = make_inputs(16, 8, 11, torch.float32, bias=True)
    cases = [dict(weight=x["weight"].bfloat16()),
             dict(hidden=x["hidden"].bfloat16(), weight=x["weight"].bfloat16())]
    for case in cases:
        args = {**x, **case}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch_fce.linear_cross_entropy(**args)
        bf16 = {**x, **{k: args[k].bfloat16() for k in ("hidden", "weight", "bias")}}
        ref_loss, _ = reference_loss_and_grads(**bf16)
        assert rel_err(loss, ref_loss) <= LOSS_TOL


def test_linear_ce_float16_gradients_survive_a_loss_scale():
    # fp16 logits gradients of a mean over many tokens underflow unless the upstream loss
    # scale is applied before they are rounded, as torch's unfused path does.
    x = make_inputs(4096, 8, 2000, torch.float16, ignore_frac=0.0)
    w = x["weight"].requires_grad_()
    scale = 2.0 ** 16
    (torch_fce.linear_cross_entropy(**x) * scale).backward()
    _, ref = reference_loss_and_grads(**x, grad_out=torch.tensor(scale))
    assert rel_err(w.grad, ref["weight"]) <= grad_tol(torch.float16, 4096)


class _LargeAllocations(TorchDispatchMode):
    """Records ops that return tensors of at least `numel` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


def test_linear_ce_backward_allocates_only_the_gradients():
    # No weight-sized temporaries in the backward: no zero-filled gradients for the
    # forward's gradient outputs, no float32 copy before the cast.
    x = make_inputs(64, 64, 4000, torch.bfloat16)
    w = x["weight"].requires_grad_()
    loss = torch_fce.linear_cross_entropy(**x)
    with _LargeAllocations(w.numel()) as mode:
        loss.backward()
    assert [op for op in mode.seen if op != "aten.detach.default"] == ["fce.scale_grad.default"]

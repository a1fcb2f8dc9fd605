"""fce::linear_ce (PyTorch backend) against the float64 reference, every option."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.testing import rel_err
from tests.helpers import (
    LOSS_TOL, allowed_error, grad_tol, reference_loss_and_grads, torch_loss_and_grads)

from .strategies import problems


def run_op(x, options, accumulator="fp32", grad_seed=0):
    """Loss and gradients of hidden/weight/bias for a random upstream gradient."""
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")
              if x[k] is not None}
    args = {**x, **leaves}
    loss = torch_fce.linear_cross_entropy(**args, **options, accumulator=accumulator)
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_seed))
    grads = torch.autograd.grad(loss, list(leaves.values()), g) if loss.numel() else \
        [torch.zeros_like(v) for v in leaves.values()]
    return loss, dict(zip(leaves, grads)), g


def assert_matches_reference(x, options, accumulator="fp32", tol=None):
    loss, grads, g = run_op(x, options, accumulator)
    assert loss.dtype == torch.float32
    ref_loss, ref_grads = reference_loss_and_grads(**x, grad_out=g, **options)
    counted = (x["target"] != -100).sum().item()
    if options["reduction"] == "mean" and counted == 0:
        assert math.isnan(loss.item())  # as torch: 0 / 0
        assert all(torch.count_nonzero(v) == 0 for v in grads.values())
        return
    assert loss.shape == ref_loss.shape
    torch_loss, torch_grads = torch_loss_and_grads(**x, grad_out=g, **options)
    assert rel_err(loss, ref_loss) <= allowed_error(LOSS_TOL, torch_loss, ref_loss)
    tol = tol or grad_tol(x["hidden"].dtype, max(x["target"].numel(), x["weight"].shape[0]))
    for name, grad in grads.items():
        assert grad.dtype == x[name].dtype, name
        allowed = allowed_error(tol, torch_grads[name], ref_grads[name])
        assert rel_err(grad, ref_grads[name]) <= allowed, name


@given(problems(), st.sampled_from(["fp32", "kahan", "input"]))
def test_linear_ce_matches_reference(problem, accumulator):
    assert_matches_reference(*problem, accumulator=accumulator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_large_vocab_prime(dtype):
    x = torch_fce.testing.make_inputs(5, 3, 65537 + 2, dtype, bias=True)  # prime V > 2^16
    assert_matches_reference(x, dict(reduction="mean", label_smoothing=0.1, softcap=None,
                                     z_loss=1e-3))


def test_linear_ce_gradcheck_float64():
    x = torch_fce.testing.make_inputs(6, 5, 7, torch.float64, bias=True, class_weight=True,
                                      ignore_frac=0.3)
    h, w, b = (x[k].requires_grad_() for k in ("hidden", "weight", "bias"))
    for reduction in ("mean", "sum", "none"):
        def f(h, w, b):
            return torch_fce.linear_cross_entropy(
                h, w, x["target"], b, x["class_weight"], reduction=reduction,
                label_smoothing=0.2, softcap=3.0, z_loss=0.1)
        assert torch.autograd.gradcheck(f, (h, w, b))

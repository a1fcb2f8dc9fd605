"""fce::linear_ce (PyTorch backend) against the float64 reference, every option."""

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from tests.helpers import assert_matches_reference, ce_problems as problems


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

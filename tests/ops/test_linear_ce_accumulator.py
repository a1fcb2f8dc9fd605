"""Accumulator modes across many chunks (a tiny workspace forces one chunk per few rows)."""

import pytest
import torch
from hypothesis import given, strategies as st

from torch_fce.ops.loop import workspace
from torch_fce.testing import make_inputs
from tests.helpers import EPS, grad_tol

from tests.helpers import ce_problems as problems
from tests.helpers import assert_matches_reference, run_op


@pytest.fixture(scope="module")
def tiny_workspace():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workspace, "_nbytes", 256)  # 64 float32 logits
        yield


@given(problems(vocab=(3, 31, 97)), st.sampled_from(["fp32", "kahan"]))
def test_linear_ce_exact_accumulators_over_chunks(tiny_workspace, problem, accumulator):
    assert_matches_reference(*problem, accumulator=accumulator)


def test_linear_ce_input_accumulator_error_is_bounded(tiny_workspace):
    # 256 chunks summed in bfloat16: each addition rounds once, so the error may grow to
    # about one epsilon per doubling of the chunk count (8 here), not more.
    x = make_inputs(512, 8, 31, torch.bfloat16, ignore_frac=0.0)
    opts = dict(reduction="sum", label_smoothing=0.0, softcap=None, z_loss=0.0)
    assert_matches_reference(x, opts, accumulator="input", tol=8 * EPS[torch.bfloat16])


def test_linear_ce_kahan_beats_plain_input_sums(tiny_workspace):
    x = make_inputs(512, 8, 31, torch.bfloat16, ignore_frac=0.0, seed=3)
    opts = dict(reduction="sum", label_smoothing=0.0, softcap=None, z_loss=0.0)
    from torch_fce.testing import rel_err
    from tests.helpers import reference_loss_and_grads

    errors = {}
    for acc in ("kahan", "input"):
        _, grads, g = run_op(x, opts, acc)
        _, ref = reference_loss_and_grads(**x, grad_out=g, **opts)
        errors[acc] = rel_err(grads["weight"], ref["weight"])
    assert errors["kahan"] <= grad_tol(torch.bfloat16, 512) < errors["input"]

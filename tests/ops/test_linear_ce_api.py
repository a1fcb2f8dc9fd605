"""The Python API's own behaviour against the float64 reference: the causal-LM shift,
int32 targets, a non-default ignore_index, strided and expanded views, and the
nn.Module form."""

import torch

import torch_fce
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import LOSS_TOL, grad_tol, reference_loss_and_grads


def _loss_and_grads(x, **options):
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")
              if x[k] is not None}
    loss = torch_fce.linear_cross_entropy(**{**x, **leaves}, **options)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


def _assert_matches(loss, grads, ref_loss, ref, n_terms):
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    for k, g in grads.items():
        assert rel_err(g, ref[k]) <= grad_tol(g.dtype, n_terms), k


def test_linear_ce_shift_pairs_position_t_with_target_t_plus_1():
    B, T, D, V = 3, 9, 8, 13
    x = make_inputs(B * T, D, V, torch.float32, ignore_frac=0.2, bias=True)
    x["hidden"] = x["hidden"].reshape(B, T, D)
    x["target"] = x["target"].reshape(B, T)
    loss, grads = _loss_and_grads(x, shift=True)
    # Reference: drop each sequence's last position and its first target by hand.
    shifted = {**x, "hidden": x["hidden"][:, :-1], "target": x["target"][:, 1:]}
    ref_loss, ref = reference_loss_and_grads(**shifted)
    full_h = torch.zeros(B, T, D, dtype=torch.float64)
    full_h[:, :-1] = ref["hidden"]  # the last position predicts nothing
    _assert_matches(loss, grads, ref_loss, {**ref, "hidden": full_h}, B * T)


def test_linear_ce_int32_targets_equal_int64():
    x = make_inputs(20, 8, 17, torch.float32, class_weight=True)
    loss64, grads64 = _loss_and_grads(x, label_smoothing=0.1)
    loss32, grads32 = _loss_and_grads({**x, "target": x["target"].int()}, label_smoothing=0.1)
    assert torch.equal(loss32, loss64)
    for k in grads64:
        assert torch.equal(grads32[k], grads64[k]), k


def test_linear_ce_custom_ignore_index():
    x = make_inputs(24, 8, 17, torch.float32, ignore_frac=0.0)
    x["target"][::3] = 5  # a real class, ignored as ignore_index
    loss, grads = _loss_and_grads(x, ignore_index=5, label_smoothing=0.2)
    ref_loss, ref = reference_loss_and_grads(**x, ignore_index=5, label_smoothing=0.2)
    _assert_matches(loss, grads, ref_loss, ref, 24)


def test_linear_ce_strided_and_expanded_target_and_class_weight():
    # Views as users pass them: a column of a wider label tensor, an expanded scalar
    # target, class weights taken with a step. Same result as their contiguous copies.
    x = make_inputs(16, 8, 11, torch.float32, class_weight=True)
    labels = torch.stack([x["target"], torch.zeros_like(x["target"])], 1)
    wide_cw = torch.stack([x["class_weight"], torch.full_like(x["class_weight"], 9.0)], 1)
    views = {**x, "target": labels[:, 0], "class_weight": wide_cw[:, 0]}
    assert not views["target"].is_contiguous() and not views["class_weight"].is_contiguous()
    loss, grads = _loss_and_grads(views, reduction="sum")
    ref_loss, ref = reference_loss_and_grads(**x, reduction="sum")
    _assert_matches(loss, grads, ref_loss, ref, 16)
    expanded = {**x, "target": torch.tensor(3).expand(16)}
    loss, grads = _loss_and_grads(expanded)
    ref_loss, ref = reference_loss_and_grads(**{**x, "target": torch.full((16,), 3)})
    _assert_matches(loss, grads, ref_loss, ref, 16)


def test_linear_ce_module_matches_functional_and_moves_class_weight():
    x = make_inputs(12, 8, 11, torch.float32, class_weight=True, bias=True)
    options = dict(reduction="sum", label_smoothing=0.1, softcap=5.0, z_loss=1e-3)
    module = torch_fce.LinearCrossEntropyLoss(class_weight=x["class_weight"], **options)
    assert module(x["hidden"], x["weight"], x["target"], x["bias"]).item() == \
        torch_fce.linear_cross_entropy(**x, **options).item()
    module = module.to(torch.float64)  # class_weight is a buffer: it follows the module
    assert module.class_weight.dtype == torch.float64
    x64 = {k: v.double() if v is not None and v.is_floating_point() else v for k, v in x.items()}
    ref_loss, _ = reference_loss_and_grads(**x64, **options)
    assert rel_err(module(x64["hidden"], x64["weight"], x64["target"], x64["bias"]),
                   ref_loss) <= 1e-12

"""Edges where the op could silently disagree with torch: transforms it does not support
raise, non-finite ignored rows, int32 targets, class weights that want a gradient,
meta tensors, in-place edits before the backward, run-to-run determinism."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import torch_fce
from torch_fce.testing import make_inputs, rel_err


def _x(dtype=torch.float64, **kw):
    return make_inputs(10, 4, 7, dtype, ignore_frac=0.3, **kw)


def _loss_fn(x, **options):
    return lambda h, w: torch_fce.linear_cross_entropy(h, w, x["target"], **options)


@pytest.mark.parametrize("transform", ["jvp", "dual", "grad", "vmap_of_grad", "jacrev"])
def test_linear_ce_refuses_forward_ad_and_functorch(transform):
    x = _x()
    h, w = x["hidden"], x["weight"]
    f = _loss_fn(x)
    run = {
        "jvp": lambda: torch.func.jvp(lambda h: f(h, w), (h,), (torch.ones_like(h),)),
        "grad": lambda: torch.func.grad(f)(h, w),
        "vmap_of_grad": lambda: torch.func.vmap(torch.func.grad(f))(h[None], w[None]),
        "jacrev": lambda: torch.func.jacrev(f)(h, w),
    }
    with pytest.raises(NotImplementedError, match="fce::linear_ce.*forward-mode"):
        if transform == "dual":
            with fwAD.dual_level():
                f(fwAD.make_dual(h, torch.ones_like(h)), w)
        else:
            run[transform]()


def test_linear_ce_vmap_of_the_forward_loops_over_the_batch():
    # No batching rule: torch's fallback runs the op once per sample, which is exact.
    xs = [_x() for _ in range(3)]
    h = torch.stack([x["hidden"] for x in xs])
    t = torch.stack([x["target"] for x in xs])
    w = xs[0]["weight"]
    got = torch.func.vmap(lambda h, t: torch_fce.linear_cross_entropy(h, w, t))(h, t)
    want = torch.stack([torch_fce.linear_cross_entropy(a, w, b) for a, b in zip(h, t)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("how", ["grad_of_grad", "hvp", "backward_of_grad"])
def test_linear_ce_second_derivatives_raise(reduction, how):
    x = _x()
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()

    def first():
        loss = torch_fce.linear_cross_entropy(h, w, x["target"], reduction=reduction).sum()
        return torch.autograd.grad(loss, (h, w), create_graph=True)

    with pytest.raises(RuntimeError, match="double backward"):
        if how == "hvp":
            torch.autograd.functional.hvp(lambda h: torch_fce.linear_cross_entropy(
                h, w.detach(), x["target"], reduction=reduction).sum(), h.detach(),
                torch.ones_like(h))
        elif how == "grad_of_grad":  # w.r.t. the other input too: no silent None
            torch.autograd.grad(first()[0].sum(), w, allow_unused=True)
        else:
            first()[1].sum().backward()


def test_linear_ce_create_graph_gradients_are_usable():
    x = _x()
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()
    gh, gw = torch.autograd.grad(torch_fce.linear_cross_entropy(h, w, x["target"]), (h, w),
                                 create_graph=True)
    ref = torch.autograd.grad(F.cross_entropy(F.linear(h, w), x["target"]), (h, w))
    assert rel_err(gh, ref[0]) <= 1e-12 and rel_err(gw, ref[1]) <= 1e-12


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_linear_ce_non_finite_ignored_rows_are_ignored(reduction, bad):
    x = _x(torch.float32, bias=True, class_weight=True)
    ignored = int((x["target"] == -100).nonzero()[0])
    x["hidden"][ignored] = bad
    h, w = x["hidden"].requires_grad_(), x["weight"]
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss = torch_fce.linear_cross_entropy(h, w, x["target"], x["bias"], x["class_weight"],
                                          **options)
    ref = F.cross_entropy(F.linear(h.double(), w.double(), x["bias"].double()), x["target"],
                          weight=x["class_weight"].double(), reduction=reduction,
                          label_smoothing=0.1)
    zl = torch.where(x["target"] != -100, torch.logsumexp(
        F.linear(h.double(), w.double(), x["bias"].double()), -1) ** 2, 0.0)
    zl = torch.nan_to_num(zl, nan=0.0, posinf=0.0) * 1e-3
    ref = ref + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / (x["target"] != -100).sum()
                 }[reduction]
    assert torch.isfinite(loss).all() and rel_err(loss, ref.float()) <= 1e-5
    loss.sum().backward()
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))
    assert torch.isfinite(h.grad).all()


def test_linear_ce_class_weight_requiring_grad_is_refused():
    x = _x(class_weight=True)
    cw = x.pop("class_weight").requires_grad_()
    with pytest.raises(ValueError, match="class_weight"):
        torch_fce.linear_cross_entropy(**x, class_weight=cw)
    with torch.no_grad():  # no gradient is asked for: as F.cross_entropy, allowed
        torch_fce.linear_cross_entropy(**x, class_weight=cw)


@pytest.mark.parametrize("shift", [False, True])
def test_linear_ce_int32_targets_with_a_wide_ignore_index(shift):
    x = _x()
    big = 2**32 + 3  # wraps to class 3 in int32: must match no target, as in int64
    x["target"][x["target"] == -100] = 3
    h, w, t = x["hidden"][None], x["weight"], x["target"][None]
    got = torch_fce.linear_cross_entropy(h, w, t.int(), ignore_index=big, shift=shift)
    want = torch_fce.linear_cross_entropy(h, w, t, ignore_index=big, shift=shift)
    assert torch.equal(got, want)
    if not shift:
        assert rel_err(got, F.cross_entropy(F.linear(h[0], w), t[0])) <= 1e-12


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_meta_tensors_propagate_shapes(reduction):
    x = {k: v if v is None else v.to("meta") for k, v in _x(torch.bfloat16).items()}
    h = x["hidden"].requires_grad_()
    loss = torch_fce.linear_cross_entropy(**x, reduction=reduction)
    assert loss.device.type == "meta" and loss.dtype == torch.float32
    assert loss.shape == (() if reduction == "mean" else x["target"].shape)
    loss.sum().backward()
    assert h.grad.shape == h.shape


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_in_place_edit_before_backward_raises(reduction):
    x = _x()
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()
    loss = torch_fce.linear_cross_entropy(h, w, x["target"], reduction=reduction).sum()
    with torch.no_grad():
        w.mul_(2.0)  # e.g. an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_linear_ce_is_deterministic_run_to_run():
    # docs/api.md, "Determinism": identical calls give identical bits (fixed threads).
    x = make_inputs(96, 24, 301, bias=True, class_weight=True)
    options = dict(label_smoothing=0.1, z_loss=1e-3, accumulator="fp32")
    first = None
    for _ in range(12):
        h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        loss = torch_fce.linear_cross_entropy(h, w, x["target"], x["bias"], x["class_weight"],
                                              **options)
        loss.backward()
        out = (loss, h.grad, w.grad)
        first = first or out
        assert all(torch.equal(a, b) for a, b in zip(out, first))

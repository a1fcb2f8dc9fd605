"""Bad input raises a clear error naming the argument, eagerly and at trace time;
inputs are never modified."""

import pytest
import torch

import torch_fce
from torch_fce.testing import make_inputs


def _x():
    return make_inputs(6, 4, 9, bias=True, class_weight=True)


CASES = [
    # (name, mutation of the inputs/options, error type, argument named in the message)
    ("hidden dtype", lambda x, o: x.update(hidden=x["hidden"].int()), TypeError, "hidden"),
    ("weight dtype", lambda x, o: x.update(weight=x["weight"].half()), TypeError, "weight"),
    ("target dtype", lambda x, o: x.update(target=x["target"].float()), TypeError, "target"),
    ("bias dtype", lambda x, o: x.update(bias=x["bias"].int()), TypeError, "bias"),
    ("weight rank", lambda x, o: x.update(weight=x["weight"][None]), ValueError, "weight"),
    ("weight D", lambda x, o: x.update(weight=x["weight"][:, :3]), ValueError, "weight"),
    ("target shape", lambda x, o: x.update(target=x["target"][:5]), ValueError, "target"),
    ("target rank", lambda x, o: x.update(target=x["target"][None]), ValueError, "target"),
    ("bias shape", lambda x, o: x.update(bias=x["bias"][:4]), ValueError, "bias"),
    ("class_weight shape", lambda x, o: x.update(class_weight=x["class_weight"][:4]),
     ValueError, "class_weight"),
    ("hidden 0-d", lambda x, o: x.update(hidden=x["hidden"][0, 0]), ValueError, "hidden"),
    ("reduction", lambda x, o: o.update(reduction="avg"), ValueError, "reduction"),
    ("label_smoothing", lambda x, o: o.update(label_smoothing=1.5), ValueError,
     "label_smoothing"),
    ("softcap", lambda x, o: o.update(softcap=0.0), ValueError, "softcap"),
    ("softcap inf", lambda x, o: o.update(softcap=float("inf")), ValueError, "softcap"),
    ("shift not bool", lambda x, o: o.update(shift="no"), TypeError, "shift"),
    ("z_loss", lambda x, o: o.update(z_loss=-1.0), ValueError, "z_loss"),
    ("accumulator", lambda x, o: o.update(accumulator="bf16"), ValueError, "accumulator"),
    ("ignore_index", lambda x, o: o.update(ignore_index=1.5), TypeError, "ignore_index"),
]


@pytest.mark.parametrize("name,mutate,error,argument", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["eager", "fake"])
def test_linear_ce_bad_input_names_argument(name, mutate, error, argument, mode):
    x, options = _x(), {}
    mutate(x, options)
    if mode == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as m:
            x = {k: v if v is None else m.from_tensor(v) for k, v in x.items()}
            with pytest.raises(error, match=argument):
                torch_fce.linear_cross_entropy(**x, **options)
        return
    with pytest.raises(error, match=argument):
        torch_fce.linear_cross_entropy(**x, **options)


def test_linear_ce_target_out_of_range_raises_index_error():
    x = _x()
    x["target"][2] = 9
    with pytest.raises(IndexError, match="target"):
        torch_fce.linear_cross_entropy(**x)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_inputs_unchanged(reduction):
    x = _x()
    for k in ("hidden", "weight", "bias"):
        x[k].requires_grad_()
    before = {k: v.detach().clone() for k, v in x.items()}
    loss = torch_fce.linear_cross_entropy(**x, reduction=reduction, shift=True)
    loss.sum().backward()
    for k, v in x.items():
        assert torch.equal(v.detach(), before[k]), k
        assert v.untyped_storage().data_ptr() != loss.untyped_storage().data_ptr()

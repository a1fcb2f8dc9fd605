"""torch.library.opcheck of the public and internal ops, per option family and dtype."""

import pytest
import torch

from torch_fce.ops.loop.chunked import ONE_DEVICE
from torch_fce.ops.linear_ce import CEOptions

from torch_fce.testing import make_inputs

FAMILIES = {
    "plain": dict(),
    "ignore": dict(ignore_index=3),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "smoothing": dict(label_smoothing=0.2),
    "softcap": dict(softcap=5.0),
    "z_loss": dict(z_loss=1e-3),
    "kahan": dict(accumulator="kahan"),
    "input": dict(accumulator="input"),
    "dft": dict(dft=True, softcap=5.0),
    "dft_none": dict(dft=True, reduction="none"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_ce_opcheck(family, dtype):
    x = make_inputs(6, 4, 9, dtype, bias=True, class_weight=family == "plain")
    x["target"] = x["target"].reshape(2, 3)
    x["hidden"] = x["hidden"].reshape(2, 3, 4).requires_grad_()
    x["weight"].requires_grad_()
    args = (x["hidden"], x["weight"], x["target"], x["bias"], x["class_weight"])
    torch.library.opcheck(torch.ops.fce.linear_ce.default, args, FAMILIES[family])


@pytest.mark.parametrize("needs", [[True, True, True], [False, True, False], [False] * 3])
def test_linear_ce_internal_ops_opcheck(needs):
    x = make_inputs(5, 4, 9, torch.bfloat16, bias=True, weight_dtype=torch.float32)
    args = (x["hidden"], x["weight"], x["target"], x["bias"], None)

    def opts(reduction, accumulator):
        return (*CEOptions(reduction=reduction, label_smoothing=0.1, softcap=3.0,
                           z_loss=1e-3, accumulator=accumulator), *ONE_DEVICE)

    for stats in (False, True):
        torch.library.opcheck(torch.ops.fce.linear_ce_fwd.default,
                              (*args, *opts("mean", "fp32"), needs, stats))
    torch.library.opcheck(torch.ops.fce.linear_ce_bwd.default,
                          (torch.randn(5), *args, *opts("none", "kahan"), needs))
    torch.library.opcheck(torch.ops.fce.linear_ce_bwd.default,
                          (torch.tensor(2.0), *args, *opts("mean", "fp32"), needs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_grad_opcheck(dtype):
    torch.library.opcheck(torch.ops.fce.scale_grad.default,
                          (torch.randn(5, 3), torch.tensor(0.5), dtype))

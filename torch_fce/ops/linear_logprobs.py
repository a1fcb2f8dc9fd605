"""fce::linear_logprobs: validates, applies autocast, flattens, calls the forward op."""

import torch

from .checks import check_inputs, check_logprob_options, check_temperature
from .linear_ce import _autocast, _refuse_transforms, int64_if_needed
from .schema import LIB


@torch.library.impl(LIB, "linear_logprobs", "CompositeImplicitAutograd")
def linear_logprobs(hidden, weight, target, bias=None, temperature=None, *, softcap=None,
                    ignore_index=-100, entropy=False, accumulator="fp32"):
    check_logprob_options(softcap, ignore_index, entropy, accumulator)
    _refuse_transforms((hidden, weight, bias, temperature))
    hidden, weight, bias = _autocast(hidden, weight, bias)  # dtypes are checked after it
    check_inputs(hidden, weight, target, bias, None)
    check_temperature(temperature, target)
    target = int64_if_needed(target, ignore_index)
    out = torch.ops.fce.linear_logprobs_fwd(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
        None if temperature is None else temperature.reshape(-1), softcap, ignore_index,
        entropy, accumulator)
    shape = target.shape
    return (out[0].reshape(shape), out[1].reshape(shape) if entropy else out[1],
            out[2].reshape(shape), out[3].reshape(shape))

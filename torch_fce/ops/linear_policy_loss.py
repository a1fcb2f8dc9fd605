"""fce::linear_policy_loss: validates, applies autocast, flattens, calls the forward op
(which forms the gradients: the loss is a scalar)."""

import torch

from .linear_ce import _autocast, _refuse_transforms, int64_if_needed
from .policy import check_policy_inputs
from .schema import LIB


@torch.library.impl(LIB, "linear_policy_loss", "CompositeImplicitAutograd")
def linear_policy_loss(hidden, weight, target, advantages, bias=None, old_logprobs=None,
                       ref_logprobs=None, token_weights=None, temperature=None, *,
                       loss_type="clip", epsilon_low=0.2, epsilon_high=None, delta=None,
                       sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, beta=0.0,
                       kl="k3", kl_ratio=False, entropy_coef=0.0, softcap=None,
                       ignore_index=-100, accumulator="fp32"):
    options = (loss_type, epsilon_low, epsilon_high, delta, sapo_temperature_pos,
               sapo_temperature_neg, beta, kl, kl_ratio, entropy_coef, softcap, ignore_index,
               accumulator)
    per_token = (advantages, old_logprobs, ref_logprobs, token_weights, temperature)
    _refuse_transforms((hidden, weight, bias, *per_token))
    hidden, weight, bias = _autocast(hidden, weight, bias)  # dtypes are checked after it
    check_policy_inputs(hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs,
                        token_weights, temperature, *options)
    target = int64_if_needed(target, ignore_index)
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    flat = [None if t is None else t.reshape(-1) for t in per_token]
    loss, _, _, _, *stats = torch.ops.fce.linear_policy_loss_fwd(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), flat[0], bias,
        *flat[1:], *options, needs)
    return (loss, *(t.reshape(target.shape) for t in stats))

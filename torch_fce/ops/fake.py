"""Fake (meta) kernels: output shapes and dtypes only, plus the argument checks."""

import torch

from .checks import check_inputs, check_logprob_options, check_options, check_temperature
from .policy import check_policy_inputs
from .chunked import grad_dtype


def _grads(hidden, weight, bias, needs_grad, keep_f32):
    return (
        hidden.new_empty(hidden.shape) if needs_grad[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape, dtype=grad_dtype(weight.dtype, keep_f32))
        if needs_grad[1] else hidden.new_empty(0),
        bias.new_empty(bias.shape, dtype=grad_dtype(bias.dtype, keep_f32))
        if needs_grad[2] else hidden.new_empty(0),
    )


@torch.library.register_fake("fce::linear_ce_fwd")
def _linear_ce_fwd_fake(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                        label_smoothing, softcap, z_loss, accumulator, needs_grad, stats):
    check_options(reduction, label_smoothing, softcap, z_loss, accumulator, ignore_index)
    check_inputs(hidden, weight, target, bias, class_weight)
    shape = target.shape if reduction == "none" else ()
    # float32 (float64 for float64 inputs, which exist for gradcheck)
    mdt = torch.promote_types(hidden.dtype, torch.float32)
    n = target.shape[0] if stats else 0
    return (hidden.new_empty(shape, dtype=mdt),
            *_grads(hidden, weight, bias, needs_grad, accumulator == "fp32"),
            hidden.new_empty(n, dtype=mdt), hidden.new_empty(n, dtype=torch.int64))


@torch.library.register_fake("fce::linear_ce_bwd")
def _linear_ce_bwd_fake(grad_loss, hidden, weight, target, bias, class_weight, ignore_index,
                        reduction, label_smoothing, softcap, z_loss, accumulator, needs_grad):
    check_options(reduction, label_smoothing, softcap, z_loss, accumulator, ignore_index)
    check_inputs(hidden, weight, target, bias, class_weight)
    return _grads(hidden, weight, bias, needs_grad, keep_f32=False)


@torch.library.register_fake("fce::scale_grad")
def _scale_grad_fake(grad, scale, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


@torch.library.register_fake("fce::linear_logprobs_fwd")
def _linear_logprobs_fwd_fake(hidden, weight, target, bias, temperature, softcap,
                              ignore_index, entropy, accumulator):
    check_logprob_options(softcap, ignore_index, entropy, accumulator)
    check_inputs(hidden, weight, target, bias, None)
    check_temperature(temperature, target)
    N, mdt = target.shape[0], torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty(N, dtype=mdt), hidden.new_empty(N if entropy else 0, dtype=mdt),
            hidden.new_empty(N, dtype=mdt), hidden.new_empty(N, dtype=torch.int64),
            hidden.new_empty(N, 3, dtype=mdt))


@torch.library.register_fake("fce::linear_logprobs_bwd")
def _linear_logprobs_bwd_fake(grad_logprob, grad_entropy, row_stats, hidden, weight, target,
                              bias, temperature, softcap, ignore_index, accumulator,
                              needs_grad):
    return _grads(hidden, weight, bias, needs_grad, keep_f32=False)


@torch.library.register_fake("fce::linear_policy_loss_fwd")
def _linear_policy_loss_fwd_fake(hidden, weight, target, advantages, bias, old_logprobs,
                                 ref_logprobs, token_weights, temperature, loss_type,
                                 epsilon_low, epsilon_high, delta, sapo_temperature_pos,
                                 sapo_temperature_neg, beta, kl, kl_ratio, entropy_coef,
                                 softcap, ignore_index, accumulator, needs_grad):
    check_policy_inputs(hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs,
                        token_weights, temperature, loss_type, epsilon_low, epsilon_high,
                        delta, sapo_temperature_pos, sapo_temperature_neg, beta, kl,
                        kl_ratio, entropy_coef, softcap, ignore_index, accumulator)
    mdt = torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty((), dtype=mdt),
            *_grads(hidden, weight, bias, needs_grad, accumulator == "fp32"),
            *(hidden.new_empty(target.shape[0], dtype=mdt) for _ in range(5)))


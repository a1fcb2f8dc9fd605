"""The PyTorch backend: CPU, and the fallback on any device without a faster kernel."""

import torch

from . import checks, chunked
from .logprob_rows import torch_logprob_rows
from .rows import torch_rows
from .workspace import chunk_rows


def _chunk_rows_for(hidden, weight):
    return chunk_rows(hidden.shape[0], max(1, weight.shape[0]), hidden.shape[1], hidden.dtype,
                      hidden.device)


def _check_targets(target, V, ignore_index):
    # On the CPU the check costs no device sync, so it always runs (docs/api.md); other
    # devices using this backend check when asked to, as CUDA does.
    if target.device.type == "cpu" or checks.CHECK_TARGETS:
        checks.check_target_range(target, V, ignore_index)


@torch.library.impl("fce::linear_ce_fwd", "CompositeExplicitAutograd")
def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, *options):
    _check_targets(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_fwd(
        hidden, weight, target, bias, class_weight, ignore_index, *options, rows=torch_rows,
        chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_ce_bwd", "CompositeExplicitAutograd")
def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, ignore_index,
                  reduction, label_smoothing, softcap, z_loss, accumulator, needs_grad):
    _check_targets(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_bwd(
        grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction,
        label_smoothing, softcap, z_loss, accumulator, needs_grad, rows=torch_rows,
        chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_logprobs_fwd", "CompositeExplicitAutograd")
def linear_logprobs_fwd(hidden, weight, target, bias, temperature, softcap, ignore_index,
                        entropy, accumulator):
    _check_targets(target, weight.shape[0], ignore_index)
    if target.device.type == "cpu" or checks.CHECK_TARGETS:
        checks.check_temperature_values(temperature)
    return chunked.linear_logprobs_fwd(
        hidden, weight, target, bias, temperature, softcap, ignore_index, entropy,
        rows=torch_logprob_rows, chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_logprobs_bwd", "CompositeExplicitAutograd")
def linear_logprobs_bwd(grad_logprob, grad_entropy, row_stats, hidden, weight, target,
                        *options):
    return chunked.linear_logprobs_bwd(
        grad_logprob, grad_entropy, row_stats, hidden, weight, target, *options,
        rows=torch_logprob_rows, chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_policy_loss_fwd", "CompositeExplicitAutograd")
def linear_policy_loss_fwd(hidden, weight, target, advantages, bias, old_logprobs,
                           ref_logprobs, token_weights, temperature, *options):
    ignore_index = options[chunked.POLICY_IGNORE_INDEX]
    _check_targets(target, weight.shape[0], ignore_index)
    if target.device.type == "cpu" or checks.CHECK_TARGETS:
        checks.check_temperature_values(temperature)
    return chunked.linear_policy_loss_fwd(
        hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs, token_weights,
        temperature, *options, rows=torch_logprob_rows,
        chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::scale_grad", "CompositeExplicitAutograd")
def scale_grad(grad, scale, dtype):
    return torch.mul(grad, scale, out=grad.new_empty(grad.shape, dtype=dtype))

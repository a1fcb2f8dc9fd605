"""The CUDA backend: the chunked loop with cuBLAS GEMMs and the Triton row kernel."""

import torch

from . import checks, chunked
from .cpu import _chunk_rows_for
from .logprob_rows import torch_logprob_rows
from .rows import torch_rows
from .triton.logprob_rows import triton_logprob_rows
from .triton.rows import triton_rows
from .triton.scale import _launch_scale_cast


def _rows(dtype):
    return torch_rows if dtype == torch.float64 else triton_rows


@torch.library.impl("fce::linear_ce_fwd", "CUDA")
def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, *options):
    if checks.CHECK_TARGETS:
        checks.check_target_range(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_fwd(
        hidden, weight, target, bias, class_weight, ignore_index, *options,
        rows=_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_ce_bwd", "CUDA")
def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, *options):
    return chunked.linear_ce_bwd(
        grad_loss, hidden, weight, target, bias, class_weight, *options,
        rows=_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


def _logprob_rows(dtype):
    return torch_logprob_rows if dtype == torch.float64 else triton_logprob_rows


@torch.library.impl("fce::linear_logprobs_fwd", "CUDA")
def linear_logprobs_fwd(hidden, weight, target, bias, temperature, softcap, ignore_index,
                        entropy, accumulator):
    if checks.CHECK_TARGETS:
        checks.check_target_range(target, weight.shape[0], ignore_index)
        checks.check_temperature_values(temperature)
    return chunked.linear_logprobs_fwd(
        hidden, weight, target, bias, temperature, softcap, ignore_index, entropy,
        rows=_logprob_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_logprobs_bwd", "CUDA")
def linear_logprobs_bwd(grad_logprob, grad_entropy, row_stats, hidden, weight, target,
                        *options):
    return chunked.linear_logprobs_bwd(
        grad_logprob, grad_entropy, row_stats, hidden, weight, target, *options,
        rows=_logprob_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_policy_loss_fwd", "CUDA")
def linear_policy_loss_fwd(hidden, weight, target, advantages, bias, old_logprobs,
                           ref_logprobs, token_weights, temperature, *options):
    if checks.CHECK_TARGETS:
        checks.check_target_range(target, weight.shape[0],
                                  options[chunked.POLICY_IGNORE_INDEX])
        checks.check_temperature_values(temperature)
    return chunked.linear_policy_loss_fwd(
        hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs, token_weights,
        temperature, *options, rows=_logprob_rows(hidden.dtype),
        chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::scale_grad", "CUDA")
def scale_grad(grad, scale, dtype):
    if torch.float64 in (grad.dtype, dtype):  # the kernel multiplies in float32
        return (grad * scale.to(grad)).to(dtype)
    out = grad.new_empty(grad.shape, dtype=dtype)
    _launch_scale_cast(grad.contiguous(), scale.to(grad.device), out)
    return out

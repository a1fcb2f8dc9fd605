"""The sparse-target cross entropy's room: fce::linear_soft_cross_entropy, whole.

Its options (SoftCEOptions), the schemas, the public op's entry, the fake kernel, the
autograd formula and the implementation on the chunk loop.

loss = sum over the tokens counted of w_t * (-sum_k p_k log softmax(z / T)[idx_k]): the
cross entropy of the student's next-token distribution at temperature T to a teacher's
stored top-k (idx, p), (N, k) per token (offline distillation); an index equal to
ignore_index is skipped, a token whose indices are all skipped is not counted; w_t the
token weights, or 1 / the tokens counted (distill.soft_ce_rows has the formulas).
The loss is a scalar, so the forward forms the gradients for a unit upstream gradient
in three GEMMs (the logits, dz @ W, dz.T @ h); the backward scales them.
"""

from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, forward_needs_grad, refuse_transforms,
                             token_rows)
from ..contract.options import take, tensor_record
from ..loop.chunked import (ONE_DEVICE, VocabShard, after_first_gemm, chunk_rows_for,
                           grad_outputs, inverse_temperature, logits_dtype_for,
                           math_dtype_for, no_autocast, run_chunks)
from ..loop.tokens import token_weights
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from ..rowmath import sparse_rows
from .rows import soft_ce_rows


class SoftCEOptions(NamedTuple):
    """linear_soft_cross_entropy's options (docs/distillation.md), in the schemas' order."""
    ignore_index: int = -100
    accumulator: str = "fp32"
    # the GEMM's float32 sums (None: rounded to the inputs' dtype)
    logits_dtype: Optional[torch.dtype] = torch.float32

    def check(self):
        """Raises naming the option; returns the record."""
        checks.check_common(self)
        return self


# ---- schemas and the public op -----------------------------------------------------

# linear_soft_cross_entropy's optional tensors (token_weights and temperature: the
# tokens' shape)
SoftCETensors = tensor_record("SoftCETensors", "bias", "token_weights", "temperature")


# The internal op takes hidden (N, D), target_indices and target_probs (N, k), the
# per-token tensors (N,), a VocabShard (weight and bias then this rank's classes).
grads.define_forward_grads_ops(
    "linear_soft_cross_entropy",
    ("Tensor hidden", "Tensor weight", "Tensor target_indices", "Tensor target_probs"),
    SoftCETensors, SoftCEOptions, ())


def check_soft_ce_inputs(hidden, weight, idx, probs, bias, token_weights_, temperature):
    """The tensors' checks, in eager mode and in the fake kernel (under torch.compile)."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"target_indices must be a Tensor, got {type(idx).__name__}")
    if idx.dtype not in checks.TARGET_DTYPES:
        raise TypeError(f"target_indices must be int64 or int32 class indices, got "
                        f"{idx.dtype}")
    checks.check_leading_shape("target_indices", idx, hidden, "k")
    tokens = idx[..., 0]  # a view of the tokens' shape for the shared checks
    checks.check_head_inputs(hidden, weight, tokens, bias, None)
    # not differentiated (a teacher's), of target_indices' shape
    checks.check_per_token("target_probs", probs, idx, like="target_indices")
    checks.check_per_token("token_weights", token_weights_, tokens, like=None)
    checks.check_temperature(temperature, tokens, like=None)


def forward(hidden, weight, idx, probs, tensors, opts, shard=ONE_DEVICE):
    """The loss for checked options and a SoftCETensors; also the vocab-parallel entry
    (weight and bias then this rank's classes)."""
    bias, token_weights_, temperature = tensors
    refuse_transforms((hidden, weight, bias))
    hidden, weight, bias = autocast_operands(hidden, weight, bias)  # dtypes checked after
    check_soft_ce_inputs(hidden, weight, idx, probs, bias, token_weights_, temperature)
    k = idx.shape[-1]
    loss, _, _, _ = torch.ops.fce.linear_soft_cross_entropy_fwd(
        token_rows(hidden), weight, idx.reshape(-1, k), probs.detach().reshape(-1, k), bias,
        flat(token_weights_), flat(temperature), *opts, *shard,
        forward_needs_grad(hidden, weight, bias))
    return loss


@torch.library.impl(LIB, "linear_soft_cross_entropy", "CompositeImplicitAutograd")
def _linear_soft_cross_entropy(hidden, weight, target_indices, target_probs, bias=None,
                               token_weights=None, temperature=None, **options):
    return forward(hidden, weight, target_indices, target_probs,
                   SoftCETensors(bias=bias, token_weights=token_weights,
                                 temperature=temperature), SoftCEOptions(**options).check())


@torch.library.register_fake("fce::linear_soft_cross_entropy_fwd")
def _fwd_fake(hidden, weight, idx, probs, bias, token_weights_, temperature, *args):
    opts, rest = take(SoftCEOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    check_soft_ce_inputs(hidden, weight, idx, probs, bias, token_weights_, temperature)
    return grads.fake_forward_grads_outputs(hidden, weight, bias, needs, opts, shard, 0)


# ---- autograd: the forward's gradients scaled by the upstream gradient -------------

def _counted(args):
    """The tokens counted, from linear_soft_cross_entropy_fwd's arguments (by name)."""
    return (args["target_indices"] != args["ignore_index"]).any(-1)


grads.register_forward_grads_autograd("linear_soft_cross_entropy_fwd", _counted)


# ---- the implementation, on the chunk loop -----------------------------------------

def _sparse_rows(backend):
    """The sparse rows for the backend (a RowMath, also a vocabulary shard's): the
    Triton kernels, or the PyTorch rows."""
    if backend.triton:
        from ..rowmath.sparse_rows_kernels import ROWS
        return ROWS
    return sparse_rows.ROWS


@kernel("linear_soft_cross_entropy_fwd")
def fwd(hidden, weight, idx, probs, bias, token_weights_, temperature, *args, backend):
    """(loss, grad_hidden, grad_weight, grad_bias): per chunk the logits, then
    soft_ce_rows (rows.py) on the backend's sparse rows; with a VocabShard
    their row sums all-reduced."""
    opts, rest = take(SoftCEOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    V = shard.vocab(weight)
    if backend.check_values:
        checks.check_target_range(idx, V, opts.ignore_index, "target_indices")
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    loss_t = hidden.new_empty(N, dtype=mdt)
    sparse = _sparse_rows(backend)

    @after_first_gemm
    def per_token():  # 1 / T, w_t
        valid = (idx != opts.ignore_index).any(-1)
        return (inverse_temperature(temperature, N, hidden.device, mdt),
                token_weights(token_weights_, valid, mdt))

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)

        def row_fn(logits, s, e):
            inv_t, weights = per_token()
            lt, dz = soft_ce_rows(logits, idx[s:e], probs[s:e], inv_t[s:e], weights[s:e],
                                  opts, mdt, hidden.dtype, any(needs), sparse.rows, shard)
            return (lt,), dz

        chunk = chunk_rows_for(hidden, weight, shard,
                               per_logit=sparse.per_logit(ldt, hidden.dtype))
        gradients = run_chunks(hidden, weight, bias, row_fn, [loss_t], needs,
                               opts.accumulator, chunk, shard=shard, logits_dtype=ldt,
                               triton=backend.sums)
    return (loss_t.sum(), *grad_outputs(hidden, weight, bias, gradients,
                                        opts.accumulator == "fp32", shard.group is not None))

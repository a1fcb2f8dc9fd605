"""The top-k log-probs' room: fce::linear_topk_logprobs, whole.

Its options (TopKOptions), the schemas, the public op's entry, the fake kernel and the
implementation on the chunk loop (token chunks, one device). Per token the k most
likely classes of softmax(softcap(logit_scale * logits) / T) and their log-probs
(rows.py has the formulas and the tie rule), and the log-prob of a given
target: what an inference server returns beside its top-k, from the head's inputs in
one pass of its GEMM, without the N x V logits. No gradient: the outputs are a
teacher's (the public op detaches its inputs).
"""

from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, int64_if_needed, refuse_transforms,
                             token_rows)
from ..contract.options import (as_float, check_int, got, schema_args, take, tensor_args,
                               tensor_record, value)
from ..loop.chunked import (ONE_DEVICE, VocabShard, chunk_rows_for, inverse_temperature,
                           logits_dtype_for, math_dtype_for, no_autocast, run_chunks)
from ..machinery.dispatch import LIB, kernel
from .rows import topk_rows

MAX_K = 256  # the row math keeps k candidates per row; larger k is a full sort's job
# the CUDA default workspace as a multiple of the loop's (loop/workspace.py says why)
_WORKSPACE_SCALE = 1.25


class TopKOptions(NamedTuple):
    """linear_topk_logprobs' options (docs/distillation.md), in the schemas' order."""
    k: int = 8
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    ignore_index: int = -100
    # the GEMM's float32 sums (None: rounded to the inputs' dtype)
    logits_dtype: Optional[torch.dtype] = torch.float32

    def check(self):
        """Raises naming the option; returns the record."""
        check_int("k", self.k)
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"k must be in [1, {MAX_K}]{got(self.k)}")
        checks.check_common(self)
        if not 0.0 < as_float("logit_scale", self.logit_scale) < float("inf"):
            raise ValueError(f"logit_scale must be a finite float > 0{got(self.logit_scale)}")
        return self


# linear_topk_logprobs' optional tensors: the bias, the target (the tokens' shape) whose
# log-prob is returned beside the top-k, the per-token temperature
TopKTensors = tensor_record("TopKTensors", "bias", "target", "temperature")

# (indices (*, k) int64, logprobs (*, k), target_logprob (*): 0 without a target)
LIB.define(f"linear_topk_logprobs(Tensor hidden, Tensor weight, {tensor_args(TopKTensors, True)}"
           f", *, {schema_args(TopKOptions, True)}) -> (Tensor indices, Tensor logprobs, "
           "Tensor target_logprob)")
# hidden (N, D), target and temperature (N,); a VocabShard: weight and bias hold this
# rank's classes.
LIB.define(f"linear_topk_logprobs_fwd(Tensor hidden, Tensor weight, {tensor_args(TopKTensors)}"
           f", {schema_args(TopKOptions)}, {schema_args(VocabShard)}) -> (Tensor indices, "
           "Tensor logprobs, Tensor target_logprob)")


def check_topk_inputs(hidden, weight, tensors, opts, shard=ONE_DEVICE):
    """The tensors' checks, in eager mode and in the fake kernel (under torch.compile)."""
    tokens = tensors.target if tensors.target is not None else \
        hidden.new_empty(hidden.shape[:-1], dtype=torch.int64)
    checks.check_head_inputs(hidden, weight, tokens, tensors.bias, None)
    V = shard.vocab(weight)
    value(opts.k <= V, f"k must be at most the vocabulary's {V} classes, got {opts.k}")
    checks.check_temperature(tensors.temperature, tokens,
                             like=None if tensors.target is None else "target")


def forward(hidden, weight, tensors, opts, shard=ONE_DEVICE):
    """(indices, logprobs, target_logprob) for checked options and a TopKTensors; also
    the vocab-parallel entry (weight and bias then this rank's classes)."""
    refuse_transforms((hidden, weight, *tensors))
    hidden, weight, bias = autocast_operands(hidden, weight, tensors.bias)
    # a teacher's outputs: nothing to differentiate
    tensors = tensors._replace(bias=None if bias is None else bias.detach())
    hidden, weight = hidden.detach(), weight.detach()
    check_topk_inputs(hidden, weight, tensors, opts, shard)
    shape = hidden.shape[:-1]
    target = int64_if_needed(tensors.target, opts.ignore_index)
    idx, lp, target_lp = torch.ops.fce.linear_topk_logprobs_fwd(
        token_rows(hidden), weight, tensors.bias, flat(target), flat(tensors.temperature),
        *opts, *shard)
    return idx.reshape(*shape, opts.k), lp.reshape(*shape, opts.k), target_lp.reshape(shape)


@torch.library.impl(LIB, "linear_topk_logprobs", "CompositeImplicitAutograd")
def _linear_topk_logprobs(hidden, weight, bias=None, target=None, temperature=None,
                          **options):
    return forward(hidden, weight, TopKTensors(bias=bias, target=target,
                                               temperature=temperature),
                   TopKOptions(**options).check())


@torch.library.register_fake("fce::linear_topk_logprobs_fwd")
def _fwd_fake(hidden, weight, *args):
    tensors, args = take(TopKTensors, args)
    opts, rest = take(TopKOptions, args)
    opts = opts.check()
    shard = take(VocabShard, rest)[0]
    check_topk_inputs(hidden, weight, tensors, opts, shard)
    N, mdt = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty(N, opts.k, dtype=torch.int64),
            hidden.new_empty(N, opts.k, dtype=mdt), hidden.new_empty(N, dtype=mdt))


# ---- the implementation, on the chunk loop -----------------------------------------

@kernel("linear_topk_logprobs_fwd")
def fwd(hidden, weight, bias, target, temperature, *args, backend):
    """Per chunk the logits, then the backend's top-k rows (a VocabShard: each rank's
    candidates and row sums merged across the group)."""
    opts, rest = take(TopKOptions, args)
    opts = opts.check()
    shard = take(VocabShard, rest)[0]
    if backend.check_values:
        if target is not None:
            checks.check_target_range(target, shard.vocab(weight), opts.ignore_index)
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    out = (hidden.new_empty(N, opts.k, dtype=torch.int64),
           hidden.new_empty(N, opts.k, dtype=mdt), hidden.new_empty(N, dtype=mdt))
    inv_t = inverse_temperature(temperature, N, hidden.device, mdt)
    if backend.triton:
        from .kernels import triton_topk_rows as rows
    else:
        rows = topk_rows

    def row_fn(logits, s, e):
        return rows(logits, None if target is None else target[s:e], inv_t[s:e], opts, mdt,
                    shard), None

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)
        # the PyTorch rows hold float32 z, two boolean masks and an int32 rank beside the
        # logits; the Triton rows a few slots per row and a float32 per 32 logits only
        per_logit = ldt.itemsize + (4 + 2 + 4 + 4 if rows is topk_rows else 0)
        run_chunks(hidden, weight, bias, row_fn, out, (False,) * 3, "fp32",
                   chunk_rows_for(hidden, weight, shard, per_logit=per_logit,
                                  scale=_WORKSPACE_SCALE, weight_grad=False),
                   shard=shard, logits_dtype=ldt, triton=backend.sums)
    return out

"""The sparse divergence's room: fce::linear_sparse_divergence, whole.

Its options (SparseDivOptions), the schemas, the public op's entry, the fake kernel,
the autograd formula and the implementation on the chunk loop; the per-token formula is
row math (rows.py, sparse_divergence_rows, and its Triton twin).

A student trained on a teacher's top-k (on-policy distillation from a server's or an
in-process teacher's linear_topk_logprobs). Per token, with S the support's valid
entries (an index equal to ignore_index, or a teacher log-prob of -inf, is not valid; a
token without valid entries is not counted) and s_j the student's full-vocabulary
log-softmax of softcap(logit_scale * logits) / T at class j, both distributions are
made proper over the support, as TRL 1.16's server and async distillation trainers do:
  tail=True:  a (K+1)-th bucket log(1 - sum_S exp(.)) for each (TRL's _add_tail_bucket,
              its clamp of the sum below 1 included)
  tail=False: each renormalised over S (minus its logsumexp over S)
then TRL's generalized JSD over that support (_jsd_divergence: beta 0 KL(teacher ||
student), 1 KL(student || teacher), between the mixture form). loss = sum_t w_t
div_t. The row math forms the logits gradient in the same pass: three GEMMs, the
gradients formed in the forward. Beside the divergence and the student's mass on the
support, the rows give the student's whole-distribution entropy (TRL's async trainer
logs it).
"""

import collections
import math
from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, forward_needs_grad, refuse_transforms,
                             token_rows)
from ..contract.options import as_float, check_bool, got, take, tensor_record
from ..loop.chunked import (ONE_DEVICE, VocabShard, after_first_gemm, chunk_rows_for,
                           grad_outputs, inverse_temperature, logits_dtype_for,
                           math_dtype_for, no_autocast, run_chunks)
from ..loop.tokens import token_weights
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from . import rows as torch_rows
from .rows import counted_tokens, impossible_entries, sparse_entries, teacher_tail

# the CUDA default workspace as a multiple of the loop's (loop/workspace.py says why)
_WORKSPACE_SCALE = 0.75


class SparseDivOptions(NamedTuple):
    """linear_sparse_divergence's options (docs/distillation.md), in the schemas' order."""
    beta: float = 0.0
    tail: bool = False
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    ignore_index: int = -100
    accumulator: str = "fp32"
    # the GEMM's float32 sums (None: rounded to the inputs' dtype)
    logits_dtype: Optional[torch.dtype] = torch.float32

    def check(self):
        """Raises naming the option; returns the record."""
        checks.check_common(self)
        if not 0.0 <= as_float("beta", self.beta) <= 1.0:
            raise ValueError(f"beta must be a float in [0, 1]{got(self.beta)}")
        check_bool("tail", self.tail)
        if not 0.0 < as_float("logit_scale", self.logit_scale) < float("inf"):
            raise ValueError(f"logit_scale must be a finite float > 0{got(self.logit_scale)}")
        return self


# linear_sparse_divergence's optional tensors (token_weights and temperature: the
# tokens' shape)
SparseDivTensors = tensor_record("SparseDivTensors", "bias", "token_weights", "temperature")


# ---- schemas and the public op -----------------------------------------------------

# The internal op takes hidden (N, D), support and teacher_logprobs (N, K), the
# per-token tensors (N,), a VocabShard (weight and bias then this rank's classes).
grads.define_forward_grads_ops(
    "linear_sparse_divergence",
    ("Tensor hidden", "Tensor weight", "Tensor support", "Tensor teacher_logprobs"),
    SparseDivTensors, SparseDivOptions, ("divergence", "student_mass", "entropy"))


def check_sparse_div_inputs(hidden, weight, support, teacher, tensors):
    """The tensors' checks, in eager mode and in the fake kernel (under torch.compile)."""
    if not isinstance(support, torch.Tensor):
        raise TypeError(f"support must be a Tensor, got {type(support).__name__}")
    if support.dtype not in checks.TARGET_DTYPES:
        raise TypeError(f"support must be int64 or int32 class indices, got {support.dtype}")
    checks.check_leading_shape("support", support, hidden, "K")
    tokens = support[..., 0]  # a view of the tokens' shape for the shared checks
    checks.check_head_inputs(hidden, weight, tokens, tensors.bias, None)
    # a teacher's, not differentiated, of support's shape
    checks.check_per_token("teacher_logprobs", teacher, support, like="support")
    checks.check_per_token("token_weights", tensors.token_weights, tokens, like=None)
    checks.check_temperature(tensors.temperature, tokens, like=None)


def forward(hidden, weight, support, teacher, tensors, opts, shard=ONE_DEVICE):
    """(loss, divergence, student_mass, entropy) for checked options and a
    SparseDivTensors; also the vocab-parallel entry (weight and bias then this rank's
    classes)."""
    refuse_transforms((hidden, weight, tensors.bias))
    hidden, weight, bias = autocast_operands(hidden, weight, tensors.bias)
    tensors = tensors._replace(bias=bias)  # dtypes checked after autocast
    check_sparse_div_inputs(hidden, weight, support, teacher, tensors)
    K, shape = support.shape[-1], hidden.shape[:-1]
    loss, _, _, _, *stats = torch.ops.fce.linear_sparse_divergence_fwd(
        token_rows(hidden), weight, support.reshape(-1, K), teacher.detach().reshape(-1, K),
        bias, flat(tensors.token_weights), flat(tensors.temperature), *opts, *shard,
        forward_needs_grad(hidden, weight, bias))
    return (loss, *(s.reshape(shape) for s in stats))


@torch.library.impl(LIB, "linear_sparse_divergence", "CompositeImplicitAutograd")
def _linear_sparse_divergence(hidden, weight, support, teacher_logprobs, bias=None,
                              token_weights=None, temperature=None, **options):
    return forward(hidden, weight, support, teacher_logprobs,
                   SparseDivTensors(bias=bias, token_weights=token_weights,
                                    temperature=temperature),
                   SparseDivOptions(**options).check())


@torch.library.register_fake("fce::linear_sparse_divergence_fwd")
def _fwd_fake(hidden, weight, support, teacher, *args):
    tensors, args = take(SparseDivTensors, args)
    opts, rest = take(SparseDivOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    check_sparse_div_inputs(hidden, weight, support, teacher, tensors)
    return grads.fake_forward_grads_outputs(hidden, weight, tensors.bias, needs, opts, shard,
                                            len(_Outputs._fields) - 1)


# ---- autograd: the forward's gradients scaled by the upstream gradient -------------

def _counted(args):
    """The tokens counted, from linear_sparse_divergence_fwd's arguments (by name)."""
    return counted_tokens(args["support"], args["teacher_logprobs"], args["ignore_index"])


grads.register_forward_grads_autograd("linear_sparse_divergence_fwd", _counted)


# ---- the implementation, on the chunk loop -----------------------------------------

# The op's per-token outputs, in the order run_chunks writes them.
_Outputs = collections.namedtuple("_Outputs", "loss divergence student_mass entropy")


def _rows(backend):
    """The sparse divergence's row function for the backend (a RowMath, also a
    vocabulary shard's): the Triton kernels, or the PyTorch rows."""
    if backend.triton:
        from .kernels import ROWS
        return ROWS
    return torch_rows.ROWS


@kernel("linear_sparse_divergence_fwd")
def fwd(hidden, weight, support, teacher, bias, token_weights_, temperature, *args, backend):
    """(loss, grad_hidden, grad_weight, grad_bias, divergence, student_mass, entropy):
    per chunk the logits, then the backend's sparse divergence rows (a VocabShard: the
    PyTorch rows, their row sums all-reduced)."""
    opts, rest = take(SparseDivOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    V = shard.vocab(weight)
    if backend.check_values:
        checks.check_target_range(support, V, opts.ignore_index, "support")
        checks.check_temperature_values(temperature)
        impossible = impossible_entries(support, teacher, opts.ignore_index)
        checks.check_log_probs(teacher, impossible, "teacher_logprobs")
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    rows = _rows(backend)
    out = _Outputs(*(hidden.new_empty(N, dtype=mdt) for _ in _Outputs._fields))

    @after_first_gemm
    def per_token():  # 1 / T, w_t (1 / the tokens counted by default), the teacher's
        # log-probs and tail; a token with impossible ones (rows.impossible_entries): the
        # stand-in -1 for them, its weight and divergence NaN
        impossible = impossible_entries(support, teacher, opts.ignore_index)
        lp = teacher.masked_fill(impossible, -1.0)
        entries = sparse_entries(support, lp, opts.ignore_index)
        nan = impossible.any(-1)
        w = token_weights(token_weights_, entries.any(-1), mdt).masked_fill(nan, math.nan)
        return (inverse_temperature(temperature, N, hidden.device, mdt), w, lp,
                teacher_tail(lp, entries).to(mdt) if opts.tail else None, nan)

    def row_fn(logits, s, e):
        inv_t, weights, lp, tail, _ = per_token()
        stats, dz = rows.rows(logits, support[s:e], lp[s:e],
                              None if tail is None else tail[s:e], inv_t[s:e], weights[s:e],
                              opts, mdt, hidden.dtype, any(needs), shard=shard)
        return _Outputs(*stats), dz

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)
        gradients = run_chunks(hidden, weight, bias, row_fn, out, needs, opts.accumulator,
                               chunk_rows_for(hidden, weight, shard,
                                              per_logit=rows.per_logit(ldt, hidden.dtype),
                                              scale=_WORKSPACE_SCALE),
                               shard=shard, logits_dtype=ldt, sparse=not opts.tail,
                               triton=backend.sums)
    divergence = out.divergence.masked_fill(per_token()[4], math.nan)
    return (out.loss.sum(), *grad_outputs(hidden, weight, bias, gradients,
                                          opts.accumulator == "fp32", shard.group is not None),
            divergence, out.student_mass, out.entropy)

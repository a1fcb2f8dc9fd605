"""The distillation loss's room: fce::linear_distillation_loss, whole.

Its options (DistillOptions), the schemas, the public op's entry, the fake kernel, the
autograd formula and the implementation on the chunk loop.

loss = sum over the tokens counted (all, or those whose target is not ignore_index) of
w_t * (divergence_t + hard_weight * CE_t): the divergence between the student's and the
teacher's next-token distributions at temperature T (TRL's generalized JSD, beta 0:
KL(teacher || student), 1: KL(student || teacher)) and the student's cross entropy at the
target (temperature 1), each head's logits after its scale and softcap
(rows.py has the formulas). The loss is a scalar, so the forward forms the
student's gradients for a unit upstream gradient in four GEMMs: per chunk the teacher's
logits (no gradient), the student's (the loop's), and the two gradient GEMMs; the
backward scales them. The teacher receives no gradient.
"""

import collections
from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, forward_needs_grad, int64_if_needed,
                             refuse_transforms, token_rows)
from ..contract.options import as_float, got, take, tensor_record, value
from ..loop.chunked import (ONE_DEVICE, LogitsGemm, VocabShard, after_first_gemm,
                           chunk_rows_for, grad_outputs, inverse_temperature,
                           logits_dtype_for, math_dtype_for, no_autocast, run_chunks)
from ..loop.tokens import token_weights
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from . import rows

# the CUDA default workspace as a multiple of the loop's (loop/workspace.py says why)
_WORKSPACE_SCALE = 1.5


class DistillOptions(NamedTuple):
    """linear_distillation_loss' options (docs/distillation.md), in the schemas' order."""
    beta: float = 0.0
    hard_weight: float = 0.0
    logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    softcap: Optional[float] = None
    teacher_softcap: Optional[float] = None
    ignore_index: int = -100
    accumulator: str = "fp32"
    # the GEMM's float32 sums (None: rounded to the inputs' dtype)
    logits_dtype: Optional[torch.dtype] = torch.float32

    def check(self):
        """Raises naming the option; returns the record."""
        checks.check_common(self)
        if not 0.0 <= as_float("beta", self.beta) <= 1.0:
            raise ValueError(f"beta must be a float in [0, 1]{got(self.beta)}")
        if not 0.0 <= as_float("hard_weight", self.hard_weight) < float("inf"):
            raise ValueError(f"hard_weight must be a finite float >= 0{got(self.hard_weight)}")
        for name in ("logit_scale", "teacher_logit_scale"):
            if not 0.0 < as_float(name, getattr(self, name)) < float("inf"):
                raise ValueError(f"{name} must be a finite float > 0{got(getattr(self, name))}")
        cap = self.teacher_softcap
        if cap is not None and not 0.0 < as_float("teacher_softcap", cap) < float("inf"):
            raise ValueError(f"teacher_softcap must be None or a finite float > 0{got(cap)}")
        return self


# ---- schemas and the public op -----------------------------------------------------

# linear_distillation_loss' optional tensors: the hard loss's target and the per-token
# tensors (the tokens' shape), both heads' biases
DistillTensors = tensor_record("DistillTensors", "target", "bias", "teacher_bias",
                               "token_weights", "temperature")


# The internal op takes hidden (N, D), teacher_hidden (N, D_t), the per-token tensors (N,).
grads.define_forward_grads_ops(
    "linear_distillation_loss",
    ("Tensor hidden", "Tensor weight", "Tensor teacher_hidden", "Tensor teacher_weight"),
    DistillTensors, DistillOptions, ("divergence", "entropy"))


def tokens_of(hidden, target):
    """A tensor of the tokens' shape on hidden's device: target, or a stand-in for the
    per-token checks when there is none."""
    if target is not None:
        return target
    return hidden.new_empty(hidden.shape[:-1], dtype=torch.int64)


def check_distill_inputs(hidden, weight, teacher_hidden, teacher_weight, target, bias,
                         teacher_bias, token_weights_, temperature, opts):
    """The tensors' checks, in eager mode and in the fake kernel (under torch.compile)."""
    if target is None and opts.hard_weight != 0.0:
        raise ValueError("hard_weight > 0 needs a target (the hard loss's labels)")
    tokens = tokens_of(hidden, target)
    checks.check_head_inputs(hidden, weight, tokens, bias, None)
    for name, t in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if teacher_weight.dtype not in (teacher_hidden.dtype, torch.float32):
        raise TypeError(f"teacher_weight must have teacher_hidden's dtype "
                        f"({teacher_hidden.dtype}) or float32, got {teacher_weight.dtype}")
    if teacher_hidden.dim() != hidden.dim():
        raise ValueError(f"teacher_hidden must have hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(teacher_hidden.shape)}")
    for a, b in zip(teacher_hidden.shape[:-1], hidden.shape[:-1]):
        value(a == b, f"teacher_hidden must have hidden's leading shape "
                      f"{tuple(hidden.shape[:-1])}, got {tuple(teacher_hidden.shape)}")
    if teacher_weight.dim() != 2:
        raise ValueError(f"teacher_weight must have shape (V, D_t), got "
                         f"{tuple(teacher_weight.shape)}")
    value(teacher_weight.shape[1] == teacher_hidden.shape[-1],
          f"teacher_weight must have shape (V, D_t) with D_t = teacher_hidden.shape[-1] = "
          f"{teacher_hidden.shape[-1]}, got {tuple(teacher_weight.shape)}")
    value(teacher_weight.shape[0] == weight.shape[0],
          f"teacher_weight has {teacher_weight.shape[0]} classes and weight "
          f"{weight.shape[0]}: the two heads must share the vocabulary (slice a padded "
          f"head to the tokenizer's classes)")
    if teacher_bias is not None:
        if not isinstance(teacher_bias, torch.Tensor):
            raise TypeError(f"teacher_bias must be a Tensor, got {type(teacher_bias).__name__}")
        dtypes = checks.bias_dtypes(teacher_hidden, teacher_weight)
        if teacher_bias.dtype not in dtypes:
            raise TypeError(f"teacher_bias must have dtype in {dtypes}, got "
                            f"{teacher_bias.dtype}")
        if teacher_bias.dim() != 1 or teacher_bias.device != hidden.device:
            raise ValueError(f"teacher_bias must be a ({weight.shape[0]},) tensor on "
                             f"{hidden.device}, got {tuple(teacher_bias.shape)} on "
                             f"{teacher_bias.device}")
        value(teacher_bias.shape[0] == weight.shape[0],
              f"teacher_bias must have shape ({weight.shape[0]},), got "
              f"{tuple(teacher_bias.shape)}")
    like = None if target is None else "target"
    checks.check_per_token("token_weights", token_weights_, tokens, like)
    checks.check_temperature(temperature, tokens, like)


def forward(hidden, weight, teacher_hidden, teacher_weight, tensors, opts, shard=ONE_DEVICE):
    """(loss, divergence, entropy) for checked options and a DistillTensors; also the
    vocab-parallel entry (both heads' weights and biases then this rank's rows of the
    shard)."""
    target, bias, teacher_bias, token_weights_, temperature = tensors
    refuse_transforms((hidden, weight, bias))
    hidden, weight, bias = autocast_operands(hidden, weight, bias)  # dtypes checked after
    teacher_hidden, teacher_weight, teacher_bias = autocast_operands(
        teacher_hidden, teacher_weight, teacher_bias)
    check_distill_inputs(hidden, weight, teacher_hidden, teacher_weight, target, bias,
                         teacher_bias, token_weights_, temperature, opts)
    target = int64_if_needed(target, opts.ignore_index)
    shape = hidden.shape[:-1]
    teacher = (token_rows(teacher_hidden).detach(), teacher_weight.detach(),  # no gradient
               None if teacher_bias is None else teacher_bias.detach())
    loss, _, _, _, div, ent = torch.ops.fce.linear_distillation_loss_fwd(
        token_rows(hidden), weight, *teacher[:2], flat(target), bias, teacher[2],
        flat(token_weights_), flat(temperature), *opts, *shard,
        forward_needs_grad(hidden, weight, bias))
    return loss, div.reshape(shape), ent.reshape(shape)


@torch.library.impl(LIB, "linear_distillation_loss", "CompositeImplicitAutograd")
def _linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, target=None,
                              bias=None, teacher_bias=None, token_weights=None,
                              temperature=None, **options):
    tensors = DistillTensors(target=target, bias=bias, teacher_bias=teacher_bias,
                             token_weights=token_weights, temperature=temperature)
    return forward(hidden, weight, teacher_hidden, teacher_weight, tensors,
                   DistillOptions(**options).check())


@torch.library.register_fake("fce::linear_distillation_loss_fwd")
def _fwd_fake(hidden, weight, teacher_hidden, teacher_weight, target, bias, teacher_bias,
              token_weights_, temperature, *args):
    opts, rest = take(DistillOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    check_distill_inputs(hidden, weight, teacher_hidden, teacher_weight, target, bias,
                         teacher_bias, token_weights_, temperature, opts)
    return grads.fake_forward_grads_outputs(hidden, weight, bias, needs, opts, shard, 2)


# ---- autograd: the forward's gradients scaled by the upstream gradient -------------

def _counted(args):
    """The tokens counted, from linear_distillation_loss_fwd's arguments (by name)."""
    target, hidden = args["target"], args["hidden"]
    if target is None:
        return torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    return target != args["ignore_index"]


grads.register_forward_grads_autograd("linear_distillation_loss_fwd", _counted)


# ---- the implementation, on the chunk loop -----------------------------------------

# The op's per-token outputs, in the order run_chunks writes them.
_Outputs = collections.namedtuple("_Outputs", "loss divergence entropy")


def _rows(backend):
    """The divergence's row function on one device for the backend (a RowMath): the
    Triton kernel, or the PyTorch rows."""
    if backend.triton:
        from .kernels import ROWS
        return ROWS
    return rows.ROWS


@kernel("linear_distillation_loss_fwd")
def fwd(hidden, weight, teacher_hidden, teacher_weight, target, bias, teacher_bias,
        token_weights_, temperature, *args, backend):
    """(loss, grad_hidden, grad_weight, grad_bias, divergence, entropy): per chunk the
    teacher's logits, then the row math on both (rows.py) over the student's.
    With a VocabShard, both heads' logits are this rank's classes and the row math's sums
    are all-reduced (the PyTorch rows on every device: the Triton kernel sweeps whole
    rows)."""
    opts, rest = take(DistillOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    if backend.check_values:
        if target is not None:
            checks.check_target_range(target, shard.vocab(weight), opts.ignore_index)
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    out = _Outputs(*(hidden.new_empty(N, dtype=mdt) for _ in _Outputs._fields))
    want = any(needs)
    # a shard group's: the PyTorch rows (their Triton twin sweeps both heads' whole rows)
    row_math = _rows(backend) if shard.group is None else rows.ROWS
    extra = {} if shard.group is None else dict(shard=shard)

    @after_first_gemm
    def per_token():  # whether counted, 1 / T, w_t
        valid = torch.ones(N, dtype=torch.bool, device=hidden.device) if target is None \
            else target != opts.ignore_index
        return (valid, inverse_temperature(temperature, N, hidden.device, mdt),
                token_weights(token_weights_, valid, mdt))

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)
        teacher = LogitsGemm(teacher_hidden, teacher_weight, teacher_bias,
                             logits_dtype_for(teacher_hidden, opts))

        def row_fn(logits, s, e):
            valid, inv_t, weights = per_token()
            loss_t, div, ent, dz = row_math.rows(
                logits, teacher(teacher_hidden[s:e]), None if target is None else target[s:e],
                valid[s:e], inv_t[s:e], weights[s:e], opts, mdt, hidden.dtype, want,
                **extra)
            return _Outputs(loss_t, div, ent), dz

        # the teacher's logits beside the student's chunk
        per_logit = teacher.dtype.itemsize + row_math.per_logit(ldt, hidden.dtype)
        chunk = chunk_rows_for(hidden, weight, shard, per_logit=per_logit,
                               scale=_WORKSPACE_SCALE)
        gradients = run_chunks(hidden, weight, bias, row_fn, out, needs, opts.accumulator,
                               chunk, shard=shard, logits_dtype=ldt, triton=backend.sums)
    loss_t, div, ent = out
    return (loss_t.sum(), *grad_outputs(hidden, weight, bias, gradients,
                                        opts.accumulator == "fp32", shard.group is not None),
            div, ent)

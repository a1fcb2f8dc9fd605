"""The cross entropy's room: fce::linear_ce and linear_ce_stats, whole.

Its options (CEOptions), the schemas, the public ops' entry (validate, autocast,
flatten, pick the gradient strategy), the fake kernels, the autograd formula and the
implementation on the chunk loop, for one device or a vocabulary shard.

`linear_ce` and `linear_ce_stats` are CompositeImplicitAutograd: under autograd and
tracing they decompose into the internal linear_ce_fwd / linear_ce_bwd, which carry
the fake kernels, the per-device kernels and the autograd formula. That split lets the
forward compute the gradients (3 GEMMs instead of 4) when the loss is a scalar, while
`torch.ops.fce.linear_ce` itself stays one node in pre-grad graphs.
"""

from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, int64_if_needed, needs_grad,
                             refuse_transforms, token_rows)
from ..contract.options import as_float, check_bool, check_choice, got, schema_args, take
from ..loop import exp_gemms
from ..loop.chunked import (ONE_DEVICE, VocabShard, after_first_gemm, chunk_rows_for,
                           grad_outputs, logits_dtype_for, math_dtype_for, no_autocast,
                           run_chunks)
from ..loop.tokens import counted_target_weights, grad_scales, reduce_loss, z_loss_term
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from . import exp_rows
from .rows import TORCH_CE_ROWS, CETerms, dft_weight, grad_coefficients

REDUCTIONS = ("mean", "sum", "none")


class CEOptions(NamedTuple):
    """linear_cross_entropy's options (docs/api.md), in the schemas' order."""
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: Optional[float] = None
    z_loss: float = 0.0
    accumulator: str = "fp32"
    logits_dtype: Optional[torch.dtype] = None  # torch.float32: the GEMM's float32 sums
    dft: bool = False  # each token's loss and gradient times its detached p(target)
    # CUDA's default workspace bounded as the log-prob family's: a vocabulary-tiled
    # head's peak (for a call that replaces such a head, as TRL's SFT integration)
    head_bound: bool = False

    def check(self):
        """Raises naming the option; returns self."""
        check_choice("reduction", self.reduction, REDUCTIONS)
        checks.check_common(self)
        if not 0.0 <= as_float("label_smoothing", self.label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1]{got(self.label_smoothing)}")
        if not as_float("z_loss", self.z_loss) >= 0.0:
            raise ValueError(f"z_loss must be >= 0{got(self.z_loss)}")
        check_bool("dft", self.dft)
        check_bool("head_bound", self.head_bound)
        # DFT weighs the negative log-likelihood; which weight a smoothing or z-loss term
        # would take is not defined, so they are refused rather than guessed.
        if self.dft and (self.label_smoothing != 0.0 or self.z_loss != 0.0):
            raise ValueError("dft=True weighs the target's negative log-likelihood only: "
                             "use it with label_smoothing=0 and z_loss=0")
        return self


_OPTS, _SHARD = schema_args(CEOptions), schema_args(VocabShard)
_TENSORS = ("Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
            "Tensor? class_weight=None")
LIB.define(f"linear_ce({_TENSORS}, *, {schema_args(CEOptions, True)}) -> Tensor")
# linear_ce with the token statistics of the same pass: lse, argmax and entropy, each
# target.shape.
LIB.define(f"linear_ce_stats({_TENSORS}, *, {schema_args(CEOptions, True)}) "
           "-> (Tensor loss, Tensor lse, Tensor argmax, Tensor entropy)")
# hidden (N, D), target (N,); a VocabShard: weight holds this rank's classes. Returns the
# loss (() or (N,)) and, for the inputs flagged in needs_grad, the gradients of the loss
# with unit upstream gradient ((0,) otherwise; requested only for reduction "mean"/
# "sum"). grad_weight and grad_bias are float32 with the "fp32" accumulator (rounded
# once, in the backward; float64 for float64 weights and bias), else in the weight's and
# the bias's dtypes. With stats (one device), also each token's lse, argmax and entropy
# ((0,) otherwise).
LIB.define(
    "linear_ce_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
    f"Tensor? class_weight, {_OPTS}, {_SHARD}, bool[3] needs_grad, bool stats) "
    "-> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, "
    "Tensor lse, Tensor argmax, Tensor entropy)")
# Gradients for the upstream gradient grad_loss (() or (N,) as the loss), recomputing
# the logits.
LIB.define(
    "linear_ce_bwd(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor target, "
    f"Tensor? bias, Tensor? class_weight, {_OPTS}, {_SHARD}, bool[3] needs_grad) "
    "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)")


# ---- the public ops ----------------------------------------------------------------

def forward(hidden, weight, target, bias, class_weight, opts, stats, shard=ONE_DEVICE):
    """(loss, lse, argmax, entropy) of the checked inputs, the token statistics (0,)
    unless stats. Also the vocab-parallel entry (distributed/vocab_parallel.py)."""
    refuse_transforms((hidden, weight, bias, class_weight))
    hidden, weight, bias = autocast_operands(hidden, weight, bias)  # dtypes checked after
    checks.check_head_inputs(hidden, weight, target, bias, class_weight, _sharded_vocab(shard))
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("class_weight must not require grad: its gradient is not computed "
                         "(as F.cross_entropy's weight); pass class_weight.detach()")
    target = int64_if_needed(target, opts.ignore_index)
    # Scalar losses get their gradients in the forward (one GEMM fewer). Per-token losses
    # need the upstream gradient first, and so does float16, whose logits gradient would
    # underflow if rounded before a loss scale (GradScaler) is applied: both recompute
    # the logits in the backward.
    needs = needs_grad(hidden, weight, bias, opts.reduction != "none"
                       and hidden.dtype != torch.float16)
    loss, *_, lse, argmax, entropy = torch.ops.fce.linear_ce_fwd(
        token_rows(hidden), weight, flat(target), bias, class_weight, *opts, *shard, needs, stats)
    loss = loss.reshape(target.shape) if opts.reduction == "none" else loss
    if stats:
        lse, argmax, entropy = (t.reshape(target.shape) for t in (lse, argmax, entropy))
    return loss, lse, argmax, entropy


@torch.library.impl(LIB, "linear_ce", "CompositeImplicitAutograd")
def _linear_ce(hidden, weight, target, bias=None, class_weight=None, **options):
    return forward(hidden, weight, target, bias, class_weight, CEOptions(**options).check(),
                   False)[0]


@torch.library.impl(LIB, "linear_ce_stats", "CompositeImplicitAutograd")
def _linear_ce_stats(hidden, weight, target, bias=None, class_weight=None, **options):
    return forward(hidden, weight, target, bias, class_weight, CEOptions(**options).check(),
                   True)


# ---- fake kernels ------------------------------------------------------------------

def _checked(hidden, weight, target, bias, class_weight, args):
    opts, rest = take(CEOptions, args)
    shard, rest = take(VocabShard, rest)
    opts.check()
    checks.check_head_inputs(hidden, weight, target, bias, class_weight, _sharded_vocab(shard))
    return opts, shard, rest


def _sharded_vocab(shard):
    """class_weight's length where it is not weight's rows (a shard's whole vocabulary)."""
    return None if shard.group is None else shard.vocab_size


def _no_shard_stats(shard, stats):
    if stats and shard.group is not None:
        raise ValueError("the token statistics (return_stats) are not formed for a "
                         "vocabulary shard")


@torch.library.register_fake("fce::linear_ce_fwd")
def _fwd_fake(hidden, weight, target, bias, class_weight, *args):
    opts, shard, (needs, stats) = _checked(hidden, weight, target, bias, class_weight, args)
    _no_shard_stats(shard, stats)
    shape = target.shape if opts.reduction == "none" else ()
    # float32 (float64 for float64 inputs, which exist for gradcheck)
    mdt = torch.promote_types(hidden.dtype, torch.float32)
    n = target.shape[0] if stats else 0
    return (hidden.new_empty(shape, dtype=mdt),
            *grads.fake_grads(hidden, weight, bias, needs, opts.accumulator == "fp32",
                              shard.group is not None),
            hidden.new_empty(n, dtype=mdt), hidden.new_empty(n, dtype=torch.int64),
            hidden.new_empty(n, dtype=mdt))


@torch.library.register_fake("fce::linear_ce_bwd")
def _bwd_fake(grad_loss, hidden, weight, target, bias, class_weight, *args):
    _, _, (needs,) = _checked(hidden, weight, target, bias, class_weight, args)
    return grads.fake_grads(hidden, weight, bias, needs, keep_f32=False)


# ---- autograd ----------------------------------------------------------------------

_HIDDEN_WEIGHT_BIAS = (0, 1, 3)  # their positions among linear_ce_fwd's arguments


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, *args = inputs
    opts, rest = take(CEOptions, args)
    shard, (needs, _) = take(VocabShard, rest)
    gh, gw, gb = output[1:4]
    ctx.mark_non_differentiable(*output[1:])  # gh, gw, gb and the token statistics
    ctx.set_materialize_grads(False)  # else autograd makes zero "gradients" of gh, gw, gb
    ctx.dtypes = grads.dtypes(hidden, weight, bias)
    ctx.precomputed = any(needs)
    ctx.opts, ctx.shard = opts, shard
    ctx.save_for_backward(hidden, weight, target, bias, class_weight,
                          *((gh, gw, gb) if ctx.precomputed else ()))


def _backward(ctx, grad_loss, *_):
    """Scales the gradients the forward formed, or (reduction "none", float16 inputs)
    recomputes the logits chunk by chunk with the upstream gradient applied before
    anything is rounded (linear_ce_bwd)."""
    if grad_loss is None:  # the loss got no gradient (grads are not materialised)
        return grads.input_grads(ctx, _HIDDEN_WEIGHT_BIAS, ())
    saved = ctx.saved_tensors  # raises if an input was modified in place since
    needs = grads.needs(ctx, _HIDDEN_WEIGHT_BIAS)
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        if ctx.precomputed:
            out = grads.scaled(saved[5:], grad_loss, ctx.dtypes, needs)
        else:
            out = torch.ops.fce.linear_ce_bwd(grad_loss, *saved, *ctx.opts, *ctx.shard,
                                              needs)
    out = [g if need else None for g, need in zip(out, needs)]
    if create_graph:
        out = grads.first_order(out, (grad_loss, *saved[:5]))
    return grads.input_grads(ctx, _HIDDEN_WEIGHT_BIAS, out)


torch.library.register_autograd("fce::linear_ce_fwd", _backward, setup_context=_setup)


# ---- the implementation, on the chunk loop -----------------------------------------


def _rows(backend):
    """The cross entropy's row functions on the backend (rows.CERows): the Triton
    kernels, or the PyTorch rows."""
    if backend.triton:
        from .kernels import TRITON_CE_ROWS
        return TRITON_CE_ROWS
    return TORCH_CE_ROWS

@kernel("linear_ce_fwd")
def fwd(hidden, weight, target, bias, class_weight, *args, backend):
    opts, rest = take(CEOptions, args)
    shard, (needs, stats) = take(VocabShard, rest)
    _no_shard_stats(shard, stats)
    V = shard.vocab(weight)
    if backend.check_values:
        checks.check_target_range(target, V, opts.ignore_index)
    scales = after_first_gemm(lambda: grad_scales(
        target, class_weight, opts, math_dtype_for(hidden.dtype))) if any(needs) else None
    with no_autocast(hidden):
        (lse, nll, smooth, argmax, entropy), gradients = _chunks(
            hidden, weight, target, bias, class_weight, opts, shard, needs, scales, stats,
            backend)
        loss = reduce_loss(nll, smooth, lse, target, class_weight, opts, V)
    none = (hidden.new_empty(0, dtype=lse.dtype), hidden.new_empty(0, dtype=torch.int64),
            hidden.new_empty(0, dtype=lse.dtype))
    return (loss, *grad_outputs(hidden, weight, bias, gradients, opts.accumulator == "fp32",
                                shard.group is not None),
            *((lse, argmax, entropy) if stats else none))


def stats_z_loss(lse, target, opts):
    """LossStats' z_loss: the z-loss term of the loss, from the token statistics' lse
    (as reduce_loss adds it)."""
    return z_loss_term(lse, int64_if_needed(target, opts.ignore_index) != opts.ignore_index,
                       opts)


@kernel("linear_ce_bwd", hidden=1)
def bwd(grad_loss, hidden, weight, target, bias, class_weight, *args, backend):
    opts, rest = take(CEOptions, args)
    shard, (needs,) = take(VocabShard, rest)
    if backend.check_values:
        checks.check_target_range(target, shard.vocab(weight), opts.ignore_index)
    scales = after_first_gemm(lambda: grad_scales(
        target, class_weight, opts, math_dtype_for(hidden.dtype), grad_loss=grad_loss))
    with no_autocast(hidden):
        _, gradients = _chunks(hidden, weight, target, bias, class_weight, opts, shard,
                               needs, scales, False, backend)
    return grad_outputs(hidden, weight, bias, gradients, keep_f32=False)


def _chunks(hidden, weight, target, bias, class_weight, opts, shard, needs, scales, stats,
            backend):
    """The cross entropy on the loop: CETerms, each (N,) (argmax and entropy None unless
    stats), and the gradients; scales() gives (ce_scale, z_scale), or scales is None
    without gradients."""
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    if backend.exp and shard.group is None and not stats and exp_rows.serves(
            hidden, weight, bias, opts):
        return _exp_chunks(hidden, weight, target, class_weight, opts, needs, scales,
                           backend)
    terms = [hidden.new_empty(N, dtype=mdt) for _ in range(3)] + (
        [hidden.new_empty(N, dtype=torch.int64), hidden.new_empty(N, dtype=mdt)]
        if stats else [])
    if shard.group is None:
        def row_fn(logits, s, e):
            if scales is None:
                out, dz = _rows(backend).stats(logits, target[s:e], class_weight, opts, stats,
                                             mdt), None
            else:
                out, dz = _rows(backend).stats_then_grad(
                    logits, target[s:e], class_weight, tuple(t[s:e] for t in scales()), opts,
                    stats, mdt, hidden.dtype)
            return out if stats else out[:3], dz
    else:
        row_fn = _shard_row_fn(hidden, weight, target, class_weight, opts, shard, scales,
                               backend)
    ldt = logits_dtype_for(hidden, opts)
    # head_bound: the log-prob family's default (token chunks)
    rows = chunk_rows_for(hidden, weight, shard, ldt,
                          log_prob_tiles=False if opts.head_bound else None)
    gradients = run_chunks(hidden, weight, bias, row_fn, terms, needs, opts.accumulator,
                           rows, shard=shard, logits_dtype=ldt, triton=backend.sums)
    return CETerms(*terms) if stats else CETerms(*terms, None, None), gradients


def _exp_chunks(hidden, weight, target, class_weight, opts, needs, scales, backend):
    """The cross entropy on the exp-GEMM pipeline (loop/exp_gemms.py, exp_rows.py)."""
    N, V = hidden.shape[0], weight.shape[0]
    terms = [hidden.new_empty(N, dtype=torch.float32) for _ in range(3)]
    valid = target != opts.ignore_index
    smoothing = opts.label_smoothing > 0.0

    rows_of = exp_rows.exp_rows
    if backend.triton:
        from .exp_kernels import triton_exp_rows as rows_of

    def row_fn(tile, s, e, m, zsum):
        sc = None if scales is None else tuple(x[s:e] for x in scales())
        out, g = rows_of(tile, target[s:e], class_weight, sc, opts, V, zsum)
        return out[:3], g

    w = (torch.ones(V, device=hidden.device) if class_weight is None else class_weight) \
        if smoothing and scales is not None else None
    rows = chunk_rows_for(hidden, weight, logits_dtype=hidden.dtype,
                          per_logit=exp_gemms.BYTES_PER_LOGIT,
                          log_prob_tiles=False if opts.head_bound else None)
    gradients = exp_gemms.run_exp_chunks(hidden, weight, row_fn, terms, needs, rows,
                               torch.where(valid, target, -1).long(), valid, w,
                               backend.sums)
    return CETerms(*terms, None, None), gradients


def _shard_row_fn(hidden, weight, target, class_weight, opts, shard, scales, backend):
    """The row function of a vocabulary shard: the shard's (lse, z_y, zsum), all-reduced
    (a max, then one stacked sum) into the whole vocabulary's, then the shard's dz from
    the global lse and the coefficients a single device uses."""
    mdt, Vs, V = math_dtype_for(hidden.dtype), weight.shape[0], shard.vocab_size
    start = shard.vocab_start
    cw = None if class_weight is None else class_weight[start:start + Vs]
    smoothing = opts.label_smoothing > 0.0

    @after_first_gemm
    def per_token():
        W = float(V) if class_weight is None else class_weight.to(mdt).sum()
        here = (target >= start) & (target < start + Vs) & (target != opts.ignore_index)
        # A target outside [0, V) lives on no rank: NaN, as on one device (not lse).
        valid, w_y = counted_target_weights(target, class_weight, opts.ignore_index, V, mdt)
        return W, torch.where(here, target - start, -1).int(), valid, w_y

    def row_fn(logits, s, e):
        W, col, valid, w_y = per_token()
        lse_here, z_y, zsum = _rows(backend).shard_stats(logits, col[s:e], cw, opts, mdt)
        M = shard.all_reduce(lse_here, "max")
        parts = [torch.exp(lse_here - M), z_y] + ([zsum] if smoothing else [])
        sums = shard.all_reduce(torch.stack(parts), "sum")
        lse = M + sums[0].log()
        v = valid[s:e]
        nll = torch.where(v, w_y[s:e] * (lse - sums[1]), 0.0)
        p_y = dft_weight(v, sums[1] - lse) if opts.dft else 1.0
        nll = nll * p_y
        smooth = torch.where(v, W * lse - sums[2], 0.0) if smoothing else torch.zeros_like(lse)
        if scales is None:
            return (lse, nll, smooth), None
        ce_scale, z_scale = (t[s:e] for t in scales())
        coeffs = grad_coefficients(ce_scale * p_y, z_scale, w_y[s:e], lse, W, V,
                                   opts.label_smoothing)
        dz = _rows(backend).shard_grad(logits, col[s:e], cw, lse, *coeffs, opts, mdt,
                                       hidden.dtype)
        return (lse, nll, smooth), dz
    return row_fn

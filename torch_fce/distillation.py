"""The distillation family's public functions: linear_distillation_loss (dense),
linear_soft_cross_entropy and linear_sparse_divergence (sparse targets: a teacher's
top-k or a sampler's), and linear_topk_logprobs (a teacher's support). As in
functional.py, each builds its op's options record by keyword (the defaults are the
record's, `_DI` and the others below) and calls the op, or its vocab-parallel form for a
DTensor weight."""

import math

import torch

from .functional import _checked, _is_dtensor, _optional_target
from .ops.contract.entry import temperature_tensor
from .ops.linear_distillation import DistillOptions, DistillTensors
from .ops.linear_soft_ce import SoftCEOptions, SoftCETensors
from .ops.linear_sparse_divergence import SparseDivOptions, SparseDivTensors
from .ops.linear_topk_logprobs import TopKOptions, TopKTensors
from .results import DistillationStats, SparseDivergenceStats, TopKLogprobs

# The records' defaults, the only place they are written (the signatures read them).
_DI, _SC, _TK = DistillOptions(), SoftCEOptions(), TopKOptions()
_SD = SparseDivOptions()


def linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, target=None,
                             bias=None, teacher_bias=None, *, beta=_DI.beta, temperature=1.0,
                             hard_weight=_DI.hard_weight, token_weights=None,
                             logit_scale=_DI.logit_scale,
                             teacher_logit_scale=_DI.teacher_logit_scale, softcap=_DI.softcap,
                             teacher_softcap=_DI.teacher_softcap,
                             ignore_index=_DI.ignore_index, shift=False,
                             accumulator=_DI.accumulator, logits_dtype=_DI.logits_dtype):
    """The divergence of a student's next-token distribution from a teacher's, from
    their heads' inputs, without either's logits: four GEMMs (docs/distillation.md).

    loss = sum over the tokens counted (every token; with a target, those whose target
    is not ignore_index) of token_weights * (divergence + hard_weight * the student's
    cross entropy at target, temperature 1). The divergence is TRL's generalized JSD
    between softmax(z_s / T) and softmax(z_t / T), z = softcap(logit_scale * logits):
    beta 0 is KL(teacher || student), beta 1 KL(student || teacher), between beta *
    KL(teacher || m) + (1 - beta) * KL(student || m), m = beta teacher + (1 - beta)
    student.

    Args:
        hidden: (*, D) bfloat16, float16 or float32 (float64 for gradcheck). weight: (V, D).
        teacher_hidden: (*, D_t) of hidden's leading shape; teacher_weight: (V, D_t),
            the same V. Neither receives a gradient.
        target: None or (*) labels (ignore_index to skip), needed by hard_weight > 0.
        bias, teacher_bias: optional (V,).
        temperature: a float > 0 or a tensor of the tokens' shape.
        token_weights: None (1 / the number of tokens counted) or the tokens' shape.
        shift: pair hidden[..., t, :] (and teacher_hidden's) with target[..., t + 1].
        logits_dtype: torch.float32 (default: both heads' GEMMs keep their float32
            sums) or None (the logits rounded to the inputs' dtypes).

    Returns:
        (loss, DistillationStats): the float32 scalar loss (differentiable w.r.t.
        hidden, weight and bias) and the detached per-token statistics.
    """
    opts = DistillOptions(beta=beta, hard_weight=hard_weight, logit_scale=logit_scale,
                          teacher_logit_scale=teacher_logit_scale, softcap=softcap,
                          teacher_softcap=teacher_softcap, ignore_index=ignore_index,
                          accumulator=accumulator, logits_dtype=logits_dtype)
    opts = _checked(opts, hidden=hidden, weight=weight, teacher_hidden=teacher_hidden,
             teacher_weight=teacher_weight)
    target, tokens = _optional_target(hidden, weight, target, bias, ignore_index, shift)
    temperature = temperature_tensor(temperature, tokens)
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel distillation
        from .distributed.dtensor import dtensor_linear_distillation_loss

        return dtensor_linear_distillation_loss(
            hidden, weight, teacher_hidden, teacher_weight,
            DistillTensors(target=target, bias=bias, teacher_bias=teacher_bias,
                           token_weights=token_weights, temperature=temperature), opts)
    out = torch.ops.fce.linear_distillation_loss(
        hidden, weight, teacher_hidden, teacher_weight, target, bias, teacher_bias,
        token_weights, temperature, **opts._asdict())
    return out[0], DistillationStats(*out[1:])


def linear_soft_cross_entropy(hidden, weight, target_indices, target_probs, bias=None, *,
                              temperature=1.0, ignore_index=_SC.ignore_index,
                              token_weights=None, shift=False, accumulator=_SC.accumulator,
                              logits_dtype=_SC.logits_dtype):
    """Cross entropy of the student's next-token distribution to sparse teacher targets
    (a stored top-k), without the logits: three GEMMs (docs/distillation.md).

    loss = sum over the tokens counted of token_weights * (-sum_k p_k log softmax(z /
    T)[idx_k]), z = F.linear(hidden, weight, bias). An index equal to ignore_index is
    skipped; a token whose indices are all skipped is not counted.

    Args:
        hidden: (*, D) bfloat16, float16 or float32 (float64 for gradcheck). weight: (V, D).
        target_indices: (*, k) int64/int32 classes; target_probs: (*, k) their
            probabilities (any float dtype; not differentiated; they need not sum to 1).
        bias: optional (V,).
        temperature: a float > 0 or a tensor of the tokens' shape.
        token_weights: None (1 / the number of tokens counted) or the tokens' shape.
        shift: pair hidden[..., t, :] with the targets of position t + 1.
        logits_dtype: torch.float32 (default: the GEMM's float32 sums) or None (the
            logits rounded to the inputs' dtype).

    Returns:
        The float32 scalar loss (float64 for float64 inputs), differentiable w.r.t.
        hidden, weight and bias.
    """
    opts = SoftCEOptions(ignore_index=ignore_index, accumulator=accumulator,
                         logits_dtype=logits_dtype)
    opts = _checked(opts, hidden=hidden, weight=weight, target_indices=target_indices,
             target_probs=target_probs)
    target_indices, target_probs, tokens = _sparse_targets(target_indices, target_probs,
                                                           ignore_index, 0.0, shift)
    temperature = temperature_tensor(temperature, tokens)
    return _sparse_call("linear_soft_cross_entropy", hidden, weight, target_indices,
                        target_probs, SoftCETensors(bias=bias, token_weights=token_weights,
                                                    temperature=temperature), opts)


def linear_sparse_divergence(hidden, weight, support, teacher_logprobs, bias=None, *,
                             beta=_SD.beta, tail=_SD.tail, temperature=1.0,
                             logit_scale=_SD.logit_scale, softcap=_SD.softcap,
                             token_weights=None, ignore_index=_SD.ignore_index, shift=False,
                             logits_dtype=_SD.logits_dtype, accumulator=_SD.accumulator):
    """The divergence of a student's next-token distribution from a teacher's top-k (a
    server's, or linear_topk_logprobs'), over that support, without the student's
    logits: three GEMMs (docs/distillation.md).

    Per token, S the support's valid entries (an index equal to ignore_index or a
    teacher log-prob of -inf is not; a token without one is not counted) and s_j the
    student's full-vocabulary log-softmax of softcap(logit_scale * logits) /
    temperature: with tail=True both distributions get a (K+1)-th bucket log(1 -
    sum_S exp(.)), with tail=False both are renormalised over S (TRL 1.16's server
    distillation); then TRL's generalized JSD over it (beta 0 KL(teacher || student),
    1 KL(student || teacher)). loss = sum over the tokens counted of token_weights *
    divergence.

    Args:
        hidden: (*, D) bfloat16, float16 or float32 (float64 for gradcheck). weight:
            (V, D). bias: optional (V,).
        support: (*, K) int64/int32 classes; teacher_logprobs: (*, K) their log-probs
            under the teacher (not differentiated).
        temperature: a float > 0 or a tensor of the tokens' shape (the student's).
        token_weights: None (1 / the number of tokens counted) or the tokens' shape.
        shift: pair hidden[..., t, :] with the support of position t + 1.
        logits_dtype: torch.float32 (default: the GEMM's float32 sums) or None.

    Returns:
        (loss, SparseDivergenceStats): the float32 scalar loss (differentiable w.r.t.
        hidden, weight and bias) and the detached per-token divergence, the student's
        mass on the support and the student's entropy.
    """
    opts = SparseDivOptions(beta=beta, tail=tail, logit_scale=logit_scale, softcap=softcap,
                            ignore_index=ignore_index, accumulator=accumulator,
                            logits_dtype=logits_dtype)
    opts = _checked(opts, hidden=hidden, weight=weight, support=support,
             teacher_logprobs=teacher_logprobs)
    support, teacher_logprobs, tokens = _sparse_targets(support, teacher_logprobs,
                                                        ignore_index, -math.inf, shift)
    temperature = temperature_tensor(temperature, tokens)
    out = _sparse_call("linear_sparse_divergence", hidden, weight, support, teacher_logprobs,
                       SparseDivTensors(bias=bias, token_weights=token_weights,
                                        temperature=temperature), opts)
    return out[0], SparseDivergenceStats(*out[1:])


def _sparse_call(name, hidden, weight, idx, values, tensors, opts):
    """fce::<name>'s outputs for sparse per-token targets (idx, values) and the op's
    tensors record, or for a DTensor weight (sharded by vocabulary) its vocab-parallel
    form's, the same on every rank."""
    if _is_dtensor(weight):
        from .distributed.dtensor import dtensor_sparse

        return dtensor_sparse(name, hidden, weight, idx, values, tensors, opts)
    return getattr(torch.ops.fce, name)(hidden, weight, idx, values, *tensors,
                                        **opts._asdict())


def _sparse_targets(idx, values, ignore_index, fill, shift):
    """(idx, values, a tensor of the tokens' shape) of sparse per-token targets (*, k);
    with shift, those of position t + 1 at position t (*, T, k), the last position's
    entries skipped (ignore_index, values `fill`)."""
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
    if shift:
        idx, values = _shifted_sparse(idx, values, ignore_index, fill)
    return idx, values, idx[..., 0] if idx.dim() > 0 else idx


def _shifted_sparse(idx, values, ignore_index, fill):
    if idx.dim() < 2 or values.dim() != idx.dim():
        raise ValueError(f"shift=True needs sparse targets of shape (*, T, k) with a "
                         f"sequence dimension, got {tuple(idx.shape)} and "
                         f"{tuple(values.shape)}")
    pad = idx.new_full((*idx.shape[:-2], 1, idx.shape[-1]), ignore_index)
    return (torch.cat([idx[..., 1:, :], pad], dim=-2),
            torch.cat([values[..., 1:, :], torch.full_like(values[..., :1, :], fill)], dim=-2))


def linear_topk_logprobs(hidden, weight, k, bias=None, *, target=None, temperature=1.0,
                         logit_scale=_TK.logit_scale, softcap=_TK.softcap,
                         ignore_index=_TK.ignore_index, shift=False,
                         logits_dtype=_TK.logits_dtype):
    """The k most likely next tokens of softmax(softcap(logit_scale * F.linear(hidden,
    weight, bias)) / temperature) and their log-probs, per token, without the logits:
    a teacher's top-k (on-policy distillation with an in-process teacher, or offline
    distillation's data) from one pass of its head (docs/distillation.md).

    Args:
        hidden: (*, D) bfloat16, float16 or float32. weight: (V, D). bias: optional (V,).
        k: 1 to min(256, V) classes per token.
        target: None or (*) classes whose log-prob to return beside the top-k
            (ignore_index: 0 there), as a server returns the sampled token's.
        temperature: a float > 0 or a tensor of the tokens' shape.
        shift: pair hidden[..., t, :] with target[..., t + 1] (needs a target).
        logits_dtype: torch.float32 (default: the GEMM's float32 sums, so bf16 rounding
            makes no ties) or None (the logits rounded to hidden's dtype, as an
            inference engine's).

    Returns:
        TopKLogprobs(indices (*, k) int64, logprobs (*, k), target_logprob (*) or None),
        detached (no gradient): by probability descending, equal probabilities by
        ascending class.
    """
    opts = TopKOptions(k=k, logit_scale=logit_scale, softcap=softcap,
                       ignore_index=ignore_index, logits_dtype=logits_dtype)
    opts = _checked(opts, hidden=hidden, weight=weight)
    target, tokens = _optional_target(hidden, weight, target, bias, ignore_index, shift)
    temperature = temperature_tensor(temperature, tokens)
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel top-k
        from .distributed.dtensor import dtensor_linear_topk_logprobs

        out = dtensor_linear_topk_logprobs(
            hidden, weight, TopKTensors(bias=bias, target=target, temperature=temperature),
            opts)
    else:
        out = torch.ops.fce.linear_topk_logprobs(hidden, weight, bias, target, temperature,
                                                 **opts._asdict())
    return TopKLogprobs(out[0], out[1], None if target is None else out[2])

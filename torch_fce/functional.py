"""The public functions, the Python entries to the ops: linear_cross_entropy,
linear_logprobs, linear_policy_loss, linear_distillation_loss,
linear_soft_cross_entropy, linear_sparse_divergence and linear_topk_logprobs. Each converts the user's arguments (shift, a scalar
temperature, per-sequence advantages), builds its op's options record by keyword (the
defaults are the record's: `_CE` and the others below) and calls the op, or its
vocab-parallel form for a DTensor weight."""

import math

import torch

from .ops.contract.checks import check_head_inputs
from .ops.contract.entry import advantages_tensor, int64_if_needed, temperature_tensor
from .ops.linear_ce import CEOptions, stats_z_loss
from .ops.linear_distillation import DistillOptions, DistillTensors
from .ops.linear_logprobs import LogProbOptions
from .ops.linear_policy_loss import PolicyOptions, PolicyTensors
from .ops.linear_soft_ce import SoftCEOptions, SoftCETensors
from .ops.linear_sparse_divergence import SparseDivOptions, SparseDivTensors
from .ops.linear_topk_logprobs import TopKOptions, TopKTensors
from .results import (DistillationStats, LogProbs, LossStats, PolicyStats,
                      SparseDivergenceStats, TopKLogprobs)

# The records' defaults, the only place they are written (the signatures read them).
_CE, _LP, _PL = CEOptions(), LogProbOptions(), PolicyOptions()
_DI, _SC, _TK = DistillOptions(), SoftCEOptions(), TopKOptions()
_SD = SparseDivOptions()


def shift_targets(target, ignore_index):
    """Causal-LM shift: position t predicts target t+1; the last position is ignored."""
    pad = target.new_full((*target.shape[:-1], 1), ignore_index)
    return torch.cat([target[..., 1:], pad], dim=-1)


def _shifted(hidden, weight, target, bias, class_weight, ignore_index, shift):
    """target, shifted when shift=True (inputs checked first, so the shift cannot fail
    on a bad argument with an unclear error)."""
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
    if not shift:
        return target
    check_head_inputs(hidden, weight, target, bias, class_weight)
    if target.dim() == 0:
        raise ValueError("shift=True needs target with a sequence dimension, got a 0-d tensor")
    return shift_targets(int64_if_needed(target, ignore_index), ignore_index)


def _checked(opts, **tensors):
    """Checks the options record (outside torch.compile: there the op's fake kernel
    checks it, since an error raised here would reach the caller as Dynamo's "Observed
    exception", without its message) and that each of `tensors` is a Tensor (named here,
    before the schema's cast error would not name it)."""
    if not torch.compiler.is_compiling():
        opts.check()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")


def _optional_target(hidden, weight, target, bias, ignore_index, shift):
    """(target, shifted when shift=True, and a tensor of the tokens' shape for the
    per-token checks) of an op whose target is optional."""
    if target is not None:
        target = _shifted(hidden, weight, target, bias, None, ignore_index, shift)
        return target, target
    if shift:
        raise ValueError("shift=True needs a target (it pairs position t with target t + 1)")
    return None, hidden[..., 0]


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None, *,
                         ignore_index=_CE.ignore_index, reduction=_CE.reduction,
                         label_smoothing=_CE.label_smoothing, softcap=_CE.softcap,
                         z_loss=_CE.z_loss, accumulator=_CE.accumulator, shift=False,
                         return_stats=False, logits_dtype=_CE.logits_dtype, dft=_CE.dft,
                         head_bound=_CE.head_bound):
    """Cross entropy of F.linear(hidden, weight, bias) against target, without the logits.

    Args:
        hidden: (*, D) bfloat16, float16 or float32.
        weight: (V, D), hidden's dtype or float32 (master weights).
        target: (*) int64/int32 class indices; ignore_index marks tokens to skip.
        bias: optional (V,). class_weight: optional (V,), as `weight=` of F.cross_entropy.
        shift: pair hidden[..., t, :] with target[..., t + 1] (causal LM); hidden is not
            copied, the last position of each sequence is ignored.
        Other options: see docs/api.md.
        return_stats: also return LossStats (per-token lse, argmax and entropy, the
            z-loss term) from the same pass, no extra GEMM (token accuracy: argmax ==
            target).
        logits_dtype: None (the logits rounded to hidden's dtype, as F.linear's) or
            torch.float32 (the GEMM's float32 sums, unrounded: bfloat16/float16 inputs
            get log-probs and gradients as of F.linear(hidden.float(), weight.float());
            docs/numerics.md). float32 and float64 inputs are unaffected.
        dft: Dynamic Fine-Tuning (TRL's loss_type="dft"): each token's loss, and its
            gradient, times the token's probability of its target, taken as a constant
            (detached); the "mean" denominator is unchanged. Not with label_smoothing or
            z_loss.
        head_bound: on CUDA, bound the default workspace as a vocabulary-tiled head's
            (the log-prob family's bound): for a call that replaces such a head (TRL's
            SFTTrainer integration) without raising the step's peak. A set workspace
            still wins.
        A DTensor weight sharded on dim 0 (vocabulary) runs the vocab-parallel loss over
        its mesh dimension (torch_fce.distributed); the loss is the same on every rank.

    Returns:
        float32 loss: () for "mean"/"sum", target.shape for "none"; with return_stats,
        (loss, LossStats).
    """
    opts = CEOptions(ignore_index=ignore_index, reduction=reduction,
                     label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                     accumulator=accumulator, logits_dtype=logits_dtype, dft=dft,
                     head_bound=head_bound)
    _checked(opts)
    target = _shifted(hidden, weight, target, bias, class_weight, ignore_index, shift)
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel loss
        if return_stats:
            raise NotImplementedError("return_stats with a DTensor (vocab-sharded) weight")
        from .distributed.dtensor import dtensor_linear_cross_entropy

        return dtensor_linear_cross_entropy(hidden, weight, target, bias, class_weight, opts)
    if not return_stats:
        return torch.ops.fce.linear_ce(hidden, weight, target, bias, class_weight,
                                       **opts._asdict())
    loss, lse, argmax, entropy = torch.ops.fce.linear_ce_stats(
        hidden, weight, target, bias, class_weight, **opts._asdict())
    return loss, LossStats(lse, argmax, stats_z_loss(lse.detach(), target, opts), entropy)


def linear_logprobs(hidden, weight, target, bias=None, *, temperature=1.0,
                    softcap=_LP.softcap, ignore_index=_LP.ignore_index, entropy=_LP.entropy,
                    accumulator=_LP.accumulator, shift=False,
                    logits_dtype=_LP.logits_dtype, top_k=_LP.top_k, top_p=_LP.top_p,
                    min_p=_LP.min_p):
    """Per-token log-probs (and entropy) of softcap(F.linear(hidden, weight, bias)) /
    temperature at target, without the logits.

    Args:
        hidden: (*, D) bfloat16, float16 or float32. weight: (V, D), hidden's dtype or
            float32. target: (*) int64/int32 sampled tokens; ignore_index marks tokens
            to skip (their outputs are 0). bias: optional (V,).
        temperature: a float > 0, or a float tensor broadcastable to target's shape
            (per sequence, per token), not differentiated.
        softcap: Gemma-style c * tanh(z / c) before the temperature. entropy: also
            return -sum_c p_c log p_c. accumulator: as for linear_cross_entropy.
        shift: pair hidden[..., t, :] with target[..., t + 1] (causal LM, as for
            linear_cross_entropy); the temperature stays with the hidden position.
        logits_dtype: as for linear_cross_entropy.
        top_k, top_p, min_p: the sampler's truncation (vLLM's rules and order, docs/rl.md):
            the log-probs, entropy and lse of the distribution it samples from (vLLM's
            processed log-probs), -inf for a target outside its kept set (no gradient).

    Returns:
        LogProbs(logprob, entropy, lse, argmax). logprob and entropy are differentiable
        w.r.t. hidden, weight and bias for any upstream gradients (docs/rl.md). A DTensor
        weight sharded on dim 0 runs the vocab-parallel version (torch_fce.distributed).
    """
    opts = LogProbOptions(softcap=softcap, ignore_index=ignore_index, entropy=entropy,
                          accumulator=accumulator, logits_dtype=logits_dtype, top_k=top_k,
                          top_p=top_p, min_p=min_p)
    _checked(opts)
    temperature = temperature_tensor(temperature, target)
    target = _shifted(hidden, weight, target, bias, None, ignore_index, shift)
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel log-probs
        from .distributed.dtensor import dtensor_linear_logprobs

        return dtensor_linear_logprobs(hidden, weight, target, bias, temperature, opts)
    out = torch.ops.fce.linear_logprobs(hidden, weight, target, bias, temperature,
                                        **opts._asdict())
    return LogProbs(out[0], out[1] if entropy else None, out[2], out[3])


def linear_policy_loss(hidden, weight, target, advantages, bias=None, *, old_logprobs=None,
                       ref_logprobs=None, loss_type=_PL.loss_type,
                       epsilon_low=_PL.epsilon_low, epsilon_high=_PL.epsilon_high,
                       delta=_PL.delta, sapo_temperature_pos=_PL.sapo_temperature_pos,
                       sapo_temperature_neg=_PL.sapo_temperature_neg, beta=_PL.beta,
                       kl=_PL.kl, kl_ratio=_PL.kl_ratio, entropy_coef=_PL.entropy_coef,
                       token_weights=None, temperature=1.0, softcap=_PL.softcap,
                       ignore_index=_PL.ignore_index, shift=False,
                       accumulator=_PL.accumulator, logits_dtype=_PL.logits_dtype,
                       top_k=_PL.top_k, top_p=_PL.top_p, min_p=_PL.min_p):
    """An RL policy loss of softcap(F.linear(hidden, weight, bias)) / temperature at the
    sampled tokens, without the logits, in three GEMMs (docs/rl.md).

    loss = sum over the tokens not ignored of token_weights * (policy term + beta * KL -
    entropy_coef * entropy); the policy term per loss_type ("clip": PPO / GRPO / DAPO /
    Dr.GRPO / BNPO, "cispo", "sapo", "reinforce") is TRL's GRPOTrainer's at token-level
    importance sampling, with ratio exp(logprob - old_logprobs) (1, with the gradient of
    logprob, without old_logprobs).

    Args:
        hidden: (*, D) bfloat16 or float32. weight: (V, D). target: (*) sampled tokens,
            ignore_index to skip. bias: optional (V,).
        advantages: (B,) or (B, 1) per sequence of a (B, T) target, or target's shape.
        old_logprobs, ref_logprobs, token_weights: None or target's shape (token_weights
            None: 1 / the number of tokens not ignored). beta > 0 needs ref_logprobs.
        epsilon_low, epsilon_high: the clip range [1 - low, 1 + high] (high defaults to
            low); cispo: epsilon_high caps the ratio. delta: "clip"'s upper bound of the
            unclipped ratio. kl: "k1", "k2" or "k3"; kl_ratio: the KL term times the
            ratio (TRL's use_bias_correction_kl). temperature: as linear_logprobs.
        shift: pair hidden[..., t, :] with target[..., t + 1]; the per-token tensors stay
            with the hidden position, as the statistics do.
        logits_dtype: as for linear_cross_entropy.
        top_k, top_p, min_p: as linear_logprobs: the policy is the sampler's truncated
            distribution (a target outside its kept set has log-prob -inf: ratio 0).

    Returns:
        (loss, PolicyStats): the float32 scalar loss (differentiable w.r.t. hidden,
        weight and bias) and the detached per-token statistics.
    """
    opts = PolicyOptions(loss_type=loss_type, epsilon_low=epsilon_low,
                         epsilon_high=epsilon_high, delta=delta,
                         sapo_temperature_pos=sapo_temperature_pos,
                         sapo_temperature_neg=sapo_temperature_neg, beta=beta, kl=kl,
                         kl_ratio=kl_ratio, entropy_coef=entropy_coef, softcap=softcap,
                         ignore_index=ignore_index, accumulator=accumulator,
                         logits_dtype=logits_dtype, top_k=top_k, top_p=top_p, min_p=min_p)
    _checked(opts)
    temperature = temperature_tensor(temperature, target)
    target = _shifted(hidden, weight, target, bias, None, ignore_index, shift)
    advantages = advantages_tensor(advantages, target)
    tensors = PolicyTensors(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                            token_weights=token_weights, temperature=temperature)
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel policy loss
        from .distributed.dtensor import dtensor_linear_policy_loss

        return dtensor_linear_policy_loss(hidden, weight, target, advantages, bias,
                                          tensors, opts)
    out = torch.ops.fce.linear_policy_loss(hidden, weight, target, advantages, bias,
                                           *tensors, **opts._asdict())
    return out[0], PolicyStats(*out[1:])


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
        hidden: (*, D) bfloat16 or float32 (float64 for gradcheck). weight: (V, D).
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
    _checked(opts, hidden=hidden, weight=weight, teacher_hidden=teacher_hidden,
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
        hidden: (*, D) bfloat16 or float32 (float64 for gradcheck). weight: (V, D).
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
    _checked(opts, hidden=hidden, weight=weight, target_indices=target_indices,
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
    _checked(opts, hidden=hidden, weight=weight, support=support,
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
    _checked(opts, hidden=hidden, weight=weight)
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


def _is_dtensor(t):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)

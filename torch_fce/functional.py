"""The public functions, the Python entries to the ops: linear_cross_entropy,
linear_logprobs and linear_policy_loss here, the distillation family in distillation.py.
Each converts the user's arguments (shift, a scalar temperature, per-sequence
advantages), builds its op's options record by keyword (the defaults are the record's:
`_CE` and the others below) and calls the op, or its vocab-parallel form for a DTensor
weight."""

import torch

from .ops.contract.checks import check_head_inputs
from .ops.contract.entry import advantages_tensor, int64_if_needed, temperature_tensor
from .ops.contract.options import integral
from .ops.linear_ce import CEOptions, stats_z_loss
from .ops.linear_logprobs import LogProbOptions
from .ops.linear_policy_loss import PolicyOptions, PolicyTensors
from .results import LogProbs, LossStats, PolicyStats

# The records' defaults, the only place they are written (the signatures read them).
_CE, _LP, _PL = CEOptions(), LogProbOptions(), PolicyOptions()
_INT_OPTIONS = ("ignore_index", "top_k", "k")  # the records' int fields


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
    """The options record, its integral numbers (numpy's too) as ints, checked (outside
    torch.compile: there the op's fake kernel checks it, since an error raised here
    would reach the caller as Dynamo's "Observed exception", without its message); and
    checks that each of `tensors` is a Tensor (named here, before the schema's cast error
    would not name it)."""
    opts = opts._replace(**{f: integral(getattr(opts, f)) for f in _INT_OPTIONS
                            if f in opts._fields})
    if not torch.compiler.is_compiling():
        opts.check()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    return opts


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
    opts = _checked(opts)
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
    opts = _checked(opts)
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
        hidden: (*, D) bfloat16, float16 or float32. weight: (V, D). target: (*) sampled
            tokens, ignore_index to skip. bias: optional (V,).
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
    opts = _checked(opts)
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


def _is_dtensor(t):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)

"""TRL 1.16: GRPOTrainer's loss through torch_fce.linear_policy_loss, SFTTrainer's
through torch_fce.linear_cross_entropy, DistillationTrainer's through
torch_fce.linear_distillation_loss, torch_fce's log-probs inside TRL's fused LM head, and
drop-ins for TRL's fused kernels (ChunkedLogProbFunction, ChunkedDivergenceFunction).

    from torch_fce.integrations import trl as fce_trl
    trainer = GRPOTrainer(model=policy, ...)   # or SFTTrainer, DistillationTrainer
    fce_trl.apply(trainer)        # the loss in three GEMMs, or a warning saying why not
    trainer.train()
    fce_trl.revert(trainer)

    with fce_trl.fused_lm_head():  # any trainer that uses add_fused_lm_head (SFT, KTO,
        trainer.train()            # RLOO, GRPO's old and reference log-probs)

apply() replaces the trainer's loss method (on the instance: GRPOTrainer's
`_compute_loss`, SFTTrainer's `compute_loss`) by one that runs the model's forward with
its head capturing the hidden states and forms TRL's loss, its normalisation and its
metrics from the fused op (DistillationTrainer's `_compute_loss` runs TRL's own, which
already works from the hidden states, with its divergence call served by torch_fce); for a configuration whose loss it cannot reproduce exactly it
warns, naming the reason, and leaves TRL's own. docs/rl.md lists what is served.
"""

import contextlib
import warnings

import torch

from ..functional import (linear_cross_entropy, linear_distillation_loss, linear_logprobs,
                          linear_policy_loss, shift_targets)
from ..extension import autocast_operands, check_options
from . import transformers as fce_hf
from .transformers import capture_of, head_operands, is_attached


def _attached(model):
    """The module attach() (or apply()) prepared, under wrappers such as
    DistributedDataParallel or a PEFT model."""
    inner = model
    while not is_attached(inner):
        if hasattr(inner, "module"):
            inner = inner.module
        elif hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        else:
            raise ValueError("this needs a model prepared by torch_fce.integrations."
                             "transformers.apply(model) (or attach(model)) first")
    return inner


def _head_inputs(model, K=None, **model_kwargs):
    """(hidden, weight, bias, softcap, outputs): the head's operands for the last K
    tokens' log-probs (position t predicts token t + 1; None: every position's hidden
    state) from one forward through `model` as given (wrappers included, so DDP's
    gradient hooks run), and the model's outputs."""
    inner = _attached(model)
    head = inner.get_output_embeddings()
    # The head, capturing, hands back its input instead of the logits.
    with capture_of(head).capturing() as capture:
        out = model(**model_kwargs)
    hidden, capture.hidden = capture.hidden, None
    hidden, bias, softcap = head_operands(inner, head,
                                          hidden if K is None else hidden[:, -K - 1:-1])
    return hidden, head.weight, bias, softcap, out


def per_token_logps_and_entropies(model, input_ids, attention_mask=None, logits_to_keep=None,
                                  *, temperature=1.0, compute_entropy=False,
                                  accumulator="fp32", **model_kwargs):
    """(logps, entropies) each (B, K) for the last K = logits_to_keep tokens of input_ids
    (all but the first when None); entropies is None unless compute_entropy.

    The values TRL's helpers compute from `logits[:, -logits_to_keep - 1:-1] /
    temperature` (`selective_log_softmax`, `entropy_from_logits`). model: prepared by
    torch_fce.integrations.transformers.apply or attach (their check refuses families
    whose logits are not softcap(scale * lm_head(hidden))), possibly wrapped
    (DistributedDataParallel: it is called through the wrapper, so its gradient
    synchronisation runs). temperature: a float or a tensor broadcastable to (B, K).
    """
    K = input_ids.shape[1] - 1 if logits_to_keep is None else int(logits_to_keep)
    if not 0 < K < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {K}")
    hidden, weight, bias, softcap, _ = _head_inputs(
        model, K, input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    out = linear_logprobs(hidden, weight, input_ids[:, -K:].to(hidden.device), bias,
                          temperature=temperature, softcap=softcap, entropy=compute_entropy,
                          accumulator=accumulator)
    return out.logprob, out.entropy


# ----------------------------------------------------------------------------------------
# TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) with torch_fce's log-probs

_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class ChunkedLogProbFunction:
    """A drop-in for `trl.kernels.ChunkedLogProbFunction`: the same `apply` arguments
    and outputs (log-probs and, as asked in `outputs`, entropy, log(sum_v p_v^2), the
    mean logit and whether the target is the most likely class), from
    torch_fce.linear_logprobs. log_sum_sq_probs costs two more forward sweeps (no
    gradient): log s(2z) - 2 log s(z) of the temperature-scaled logits z, s(x) =
    sum_v exp(x_v - max x) (relative to the row max, as TRL's kernel).
    mean_logits is exact: h . (sum_v w_v) for a linear head; with a softcap one more
    forward sweep of the logits (no gradient). Refused (ValueError): a DeepSpeed ZeRO-3
    weight (gathered only while TRL's head runs, so not there for the gradients this
    forms)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size=None,
              final_logit_softcapping=None, logit_scale=1.0, outputs=_OPTIONAL_OUTPUTS,
              accumulator="fp32"):
        unknown = set(outputs) - {"log_probs", *_OPTIONAL_OUTPUTS}
        if unknown:
            raise ValueError(f"outputs must be among {('log_probs',) + _OPTIONAL_OUTPUTS}, "
                             f"got {sorted(unknown)}")
        why = _unserved(weight)
        if why:
            raise ValueError(f"torch_fce does not serve {why}")
        # TRL computes in autocast's dtype: cast before the logit scale, as it does
        hidden, weight, bias = autocast_operands(hidden, weight, bias)
        if logit_scale != 1.0:  # softcap(scale * (h W^T + b)) = softcap((scale h) W^T + scale b)
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        out = linear_logprobs(hidden, weight, targets, bias, temperature=temperature,
                              softcap=final_logit_softcapping, entropy="entropy" in outputs,
                              accumulator=accumulator)
        sq = mean = None
        with torch.no_grad():
            if "log_sum_sq_probs" in outputs:
                # log sum_v p_v^2 = log s(2z) - 2 log s(z), the sums relative to the row
                # max: the log-prob of the most likely class is exactly -log s (as TRL's
                # kernel, no rounded lse cancels against another)
                def top(t):  # the most likely class's log-prob at t: -log s(z / t)
                    return linear_logprobs(hidden, weight, out.argmax, bias, temperature=t,
                                           softcap=final_logit_softcapping).logprob

                sq = 2 * top(temperature) - top(temperature / 2)
            if "mean_logits" in outputs:  # mean_v softcap(scale (h . w_v + b_v)) / T
                mean = _mean_logits(hidden, weight, bias, final_logit_softcapping,
                                    out.lse.dtype) / temperature
        top1 = out.argmax == targets if "is_top1" in outputs else None
        return out.logprob, out.entropy, sq, mean, top1


def _mean_logits(hidden, weight, bias, softcap, dtype):
    """Each row's mean logit over the classes, softcapped, in dtype (float32): without a
    softcap the mean of a linear map, h . mean_v w_v (one GEMV); with one, the logits
    themselves in chunks of at most 2^22, as the loop's workspace."""
    with torch.autocast(hidden.device.type, enabled=False):
        V = weight.shape[0]
        if softcap is None:
            mean = hidden.to(dtype) @ weight.sum(0, dtype=dtype)
            return (mean if bias is None else mean + bias.sum(dtype=dtype)) / V
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        step = max(1, 2 ** 22 // V)
        mean = torch.cat([
            (softcap * torch.tanh(torch.nn.functional.linear(flat_h[s:s + step], w, b)
                                  .to(dtype) / softcap)).mean(-1)
            for s in range(0, flat_h.shape[0], step)]) if flat_h.shape[0] else \
            flat_h.new_empty(0, dtype=dtype)
        return mean.reshape(hidden.shape[:-1])


def _unserved(weight):
    """What of a fused-head call the drop-in cannot serve exactly, or None."""
    if hasattr(weight, "ds_id"):
        return "a DeepSpeed ZeRO-3 weight (gathered only while TRL's head runs)"
    return None


@contextlib.contextmanager
def fused_lm_head(accumulator="fp32"):
    """While active, every fused LM head TRL adds (`add_fused_lm_head`: GRPO, RLOO, SFT,
    KTO, ...) computes its log-probs with torch_fce instead of TRL's kernel (process-
    wide: it swaps the function TRL's head calls, and puts TRL's back on exit); a call
    the drop-in does not serve runs TRL's kernel, with a warning."""
    import trl.trainer.utils as trl_utils

    check_options("linear_logprobs", accumulator=accumulator)
    theirs = trl_utils._ChunkedLogProbFunction

    class _Ours:
        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None,
                  logit_scale=1.0, outputs=_OPTIONAL_OUTPUTS):
            args = (hidden, weight, bias, targets, temperature, chunk_size, softcap,
                    logit_scale, outputs)
            why = _unserved(weight)
            if why:
                warnings.warn(f"torch_fce.integrations.trl.fused_lm_head: TRL's kernel "
                              f"serves this call: torch_fce does not serve {why}",
                              stacklevel=2)
                return theirs.apply(*args)
            return ChunkedLogProbFunction.apply(*args, accumulator=accumulator)

    trl_utils._ChunkedLogProbFunction = _Ours
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = theirs


# ----------------------------------------------------------------------------------------
# GRPOTrainer's loss through linear_policy_loss

_LOSS_TYPES = {"grpo": "clip", "dapo": "clip", "dr_grpo": "clip", "bnpo": "clip",
               "cispo": "cispo", "sapo": "sapo"}
# Inputs of vision-language batches; their forward is not reproduced here.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
               "mm_token_type_ids", "image_position_ids")


# The TRL release whose trainer losses _grpo_loss and _sft_loss reproduce (and tests check).
TRL_VERSION = "1.16"
# The attribute apply() leaves on a trainer: the name of the loss method it replaced.
_APPLIED = "_torch_fce_loss"


def _unsupported_trainer(trainer):
    """(the loss method apply() replaces, None) for a trainer whose loss torch_fce
    reproduces exactly, else (None, why not)."""
    import trl
    from trl import DistillationTrainer, GRPOTrainer, SFTTrainer

    if trl.__version__.rsplit(".", 1)[0] != TRL_VERSION:
        return None, (f"it reproduces TRL {TRL_VERSION}'s trainer losses, and TRL "
                      f"{trl.__version__} is installed (its loss code may differ)")
    if isinstance(trainer, GRPOTrainer):
        return "_compute_loss", _unsupported_grpo(trainer)
    if isinstance(trainer, SFTTrainer):
        return "compute_loss", _unsupported_sft(trainer)
    if isinstance(trainer, DistillationTrainer):
        return "_compute_loss", _unsupported_distill(trainer)
    return None, (f"it serves GRPOTrainer, SFTTrainer and DistillationTrainer, got a "
                  f"{type(trainer).__name__}")


def _zero3(trainer):
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def _forward_grads_refusal(trainer, base, methods, op):
    """Why a trainer whose loss `op` serves (a loss forming its gradients in the
    forward) cannot be served, as far as every such trainer goes, or None: a subclass
    overriding one of `methods` of `base`, float16, ZeRO-3."""
    for method in methods:
        if getattr(type(trainer), method) is not getattr(base, method):
            return f"{type(trainer).__name__} overrides {method}"
    if trainer.args.fp16 or _base_model(trainer.model).dtype == torch.float16:
        return (f"float16 ({op} takes float16, but the trainer integration is checked "
                f"against TRL's losses in bf16 and float32 only: use bf16)")
    if _zero3(trainer):
        return ("DeepSpeed ZeRO-3 (the head's weight is gathered only inside its forward, "
                "and the loss reads it after)")
    return None


def _unsupported_grpo(trainer):
    """Why torch_fce cannot reproduce this GRPOTrainer's loss exactly, or None."""
    from trl import GRPOTrainer

    why = _forward_grads_refusal(trainer, GRPOTrainer, ("_compute_loss",
                                                        "_get_per_token_logps_and_entropies"),
                                 "linear_policy_loss")
    if why is not None:
        return why
    if trainer.loss_type not in _LOSS_TYPES:
        return f"loss_type={trainer.loss_type!r} (served: {', '.join(_LOSS_TYPES)})"
    if trainer.importance_sampling_level != "token":
        return ("importance_sampling_level='sequence' (its ratio is a sequence mean of the "
                "log-ratios the loss computes)")
    if trainer.top_entropy_quantile < 1.0:
        return ("top_entropy_quantile < 1 (its mask is a quantile of the entropies the loss "
                "computes)")
    if trainer.off_policy_mask_threshold is not None:
        return ("off_policy_mask_threshold (its mask depends on the log-probs the loss "
                "computes)")
    if trainer.use_adaptive_entropy:
        return "use_adaptive_entropy"
    if trainer.entropy_coef != 0.0 and trainer.beta != 0.0 and trainer.loss_type != "bnpo":
        return (f"an entropy bonus with a KL term under loss_type={trainer.loss_type!r} "
                "(TRL normalises the bonus by the token count and the KL as the policy "
                "term: two per-token weightings, where linear_policy_loss takes one)")
    return None


def _unsupported_sft(trainer):
    """Why torch_fce cannot reproduce this SFTTrainer's loss exactly, or None."""
    from trl import SFTTrainer

    if type(trainer).compute_loss is not SFTTrainer.compute_loss:
        return f"{type(trainer).__name__} overrides compute_loss"
    if trainer.compute_loss_func is not None:
        return "a compute_loss_func (it is given the model's logits)"
    if trainer.args.loss_type not in ("nll", "dft"):
        return f"loss_type={trainer.args.loss_type!r} (served: nll, dft)"
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is not None and (getattr(config, "sp_enabled", False)
                               or getattr(config, "cp_enabled", False)):
        return ("sequence or context parallelism (the loss is reduced across ranks by the "
                "trainer, over pre-shifted labels)")
    if trainer.get_tp_size() > 1:
        return "tensor parallelism (the head's weight is sharded when the loss runs)"
    if _zero3(trainer):
        return ("DeepSpeed ZeRO-3 (the head's weight is gathered only inside its forward, "
                "and the loss reads it after)")
    return None


def _unsupported_distill(trainer):
    """Why torch_fce cannot reproduce this DistillationTrainer's loss exactly, or None."""
    from trl import DistillationTrainer

    return _forward_grads_refusal(trainer, DistillationTrainer,
                                  ("compute_loss", "_compute_loss"),
                                  "linear_distillation_loss")


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply(trainer, *, accumulator="fp32"):
    """Makes a TRL 1.16 GRPOTrainer or SFTTrainer (instance, reversibly) compute its loss
    with torch_fce's fused ops; returns the trainer.

    GRPOTrainer, through linear_policy_loss: loss_type grpo, dapo, dr_grpo, bnpo, cispo
    and sapo at token-level importance sampling, any beta (the k3 KL, with or without
    the ratio's bias correction), delta, vLLM importance-sampling correction, tool
    masks, a static entropy bonus (with beta != 0 under bnpo only), MoE router losses,
    gradient accumulation, train and eval, bf16 and float32.
    SFTTrainer, through linear_cross_entropy in three GEMMs: loss_type nll and dft,
    label_smoothing_factor (without the logits), completion and assistant masks,
    padding-free batches, the MoE router aux loss, num_items_in_batch and
    average_tokens_across_devices, train and eval, and the metrics it logs (entropy,
    mean_token_accuracy, num_tokens, aux_loss) from the same pass.
    DistillationTrainer, through linear_distillation_loss in four GEMMs (TRL's kernel
    runs six, eight for the JSD): any beta and temperature, both models' logit scales,
    softcaps and head biases, completion and tool masks, num_items_in_batch, FSDP2
    (DTensor) heads gathered as TRL does, train and eval, the entropy metric, and no
    host sync (TRL's compacts the masked tokens).
    All: the same loss, gradients and logged metrics as TRL's. Anything else (GRPO's
    sequence-level importance sampling, entropy or off-policy masking, adaptive entropy,
    loss types vespo and luspo, float16; SFT's compute_loss_func, sequence, context or
    tensor parallelism; DeepSpeed ZeRO-3, a head or family torch_fce does not reproduce,
    a subclass overriding the loss, a TRL release other than 1.16; a logit scale that is
    not > 0): one warning naming the reason, and TRL's own loss. A batch apply() does not reproduce (vision inputs;
    SFT's return_outputs=True, which asks for the logits) runs TRL's loss, with a
    warning.
    """
    if hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is already applied to this trainer")
    check_options("linear_logprobs", accumulator=accumulator)
    method, why = _unsupported_trainer(trainer)
    distill = _is_distill(trainer)
    if why is None and not distill:  # the distillation reads the heads' inputs itself
        try:
            fce_hf.attach(_base_model(trainer.model))
        except ValueError as e:
            why = str(e)
    if why is not None:
        warnings.warn(f"torch_fce.integrations.trl.apply: the trainer keeps TRL's own loss: "
                      f"{why}", stacklevel=2)
        return trainer

    if distill:
        def loss(unwrapped_student, inputs, num_items_in_batch):
            return _distill_loss(trainer, unwrapped_student, inputs, num_items_in_batch,
                                 accumulator)
    elif method == "_compute_loss":
        def loss(model, inputs):
            return _grpo_loss(trainer, model, inputs, accumulator)
    else:
        def loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            return _sft_loss(trainer, model, inputs, return_outputs, num_items_in_batch,
                             accumulator)

    setattr(trainer, method, loss)
    setattr(trainer, _APPLIED, method)
    return trainer


def revert(trainer):
    """Undoes apply(): TRL's own loss again."""
    if not hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is not applied to this trainer")
    delattr(trainer, vars(trainer).pop(_APPLIED))
    if not _is_distill(trainer):
        fce_hf.detach(_base_model(trainer.model))
    return trainer


def _is_distill(trainer):
    try:
        from trl import DistillationTrainer
    except ImportError:
        return False
    return isinstance(trainer, DistillationTrainer)


def _multimodal(trainer, inputs):
    """Warns and returns True for a batch with vision inputs (TRL's loss computes it)."""
    present = [k for k in _MULTIMODAL if inputs.get(k) is not None]
    if present:
        warnings.warn(f"torch_fce.integrations.trl: this batch has {present}: TRL's own "
                      "loss computes it", stacklevel=4)
    return bool(present)


def _grpo_loss(trainer, model, inputs, accumulator):
    """GRPOTrainer._compute_loss, for the configurations _unsupported_grpo() lets through."""
    if _multimodal(trainer, inputs):
        return type(trainer)._compute_loss(trainer, model, inputs)
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    K = completion_ids.size(1)
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    kwargs = {"use_cache": False}
    if trainer.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    with trainer.accelerator.autocast():
        hidden, weight, bias, softcap, out = _head_inputs(
            model, K, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    mode = "train" if trainer.model.training else "eval"
    ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    m = mask.to(device=hidden.device, dtype=dt)
    B = m.shape[0]

    # TRL's normalisation of the policy (and KL) terms, as per-token weights
    loss_type = trainer.loss_type
    if loss_type in ("grpo", "sapo"):
        w = m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B * ga)
    elif loss_type == "bnpo":
        w = m / (m.sum().clamp(min=1.0) * ga)
    elif loss_type == "dr_grpo":
        w = m / (B * trainer.max_completion_length * ga)
    else:  # dapo, cispo: num_items_in_batch spans the generation batch
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * ga / trainer.args.steps_per_generation
        w = m / normalizer.to(device=m.device, dtype=dt)

    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    A = advantages.to(device=m.device, dtype=dt).expand_as(m)
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        # the policy term times the IS ratio (>= 0) is the term at A * ratio, also clipped
        A = A * inputs["importance_sampling_ratio"].to(device=m.device, dtype=dt)
    coef = trainer.entropy_coef if trainer._entropy_bonus_enabled else 0.0
    token_weights = w
    if coef != 0.0 and loss_type != "bnpo":
        # TRL's bonus is a token mean (weights e); the policy terms are linear in A, so
        # weights e with advantages A * w / e give them their weights w (beta is 0 here).
        e = m / (m.sum().clamp(min=1.0) * ga)
        A = A * torch.where(e > 0, w / torch.where(e > 0, e, 1.0), 0.0)
        token_weights = e
    target = completion_ids.to(hidden.device).masked_fill(m == 0, -100)
    old = inputs.get("old_per_token_logps")
    ref = inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None
    clip = _LOSS_TYPES[loss_type] == "clip"
    loss, stats = linear_policy_loss(
        hidden, weight, target, A, bias, old_logprobs=old, ref_logprobs=ref,
        loss_type=_LOSS_TYPES[loss_type], epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high, delta=trainer.args.delta if clip else None,
        sapo_temperature_pos=trainer.args.sapo_temperature_pos,
        sapo_temperature_neg=trainer.args.sapo_temperature_neg, beta=trainer.beta, kl="k3",
        kl_ratio=trainer.args.use_bias_correction_kl,
        entropy_coef=coef, token_weights=token_weights, temperature=trainer.temperature,
        softcap=softcap, accumulator=accumulator)

    metrics = trainer._metrics[mode]
    if trainer._entropy_bonus_enabled:
        # TRL's policy_loss: before the bonus; not divided by ga where TRL divides after
        policy_loss = loss.detach() + coef * (token_weights * stats.entropy).sum()
        if loss_type not in ("dapo", "cispo"):
            policy_loss = policy_loss * ga
        metrics["policy_loss"].append(trainer.accelerator.gather(policy_loss).nanmean().item())
        if mode == "train" and trainer.accelerator.sync_gradients:
            metrics["entropy_coef"].append(trainer.entropy_coef)
    if trainer.aux_loss_enabled:
        aux_loss = out.aux_loss.to(loss.device)
        loss = loss + trainer.router_aux_loss_coef * aux_loss / ga
        metrics["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_metrics(trainer, metrics, stats, mask.to(m.device), advantages.to(m.device))
    return loss


def _log_metrics(trainer, metrics, stats, mask, advantages):
    """The metrics GRPOTrainer._compute_loss logs, from the op's per-token statistics,
    in TRL's dtypes (its clip fractions are float32)."""
    from trl.trainer.utils import nanmax, nanmin

    def global_masked_mean(x):
        local = torch.stack([(x * mask).sum(), mask.sum().float()])
        totals = trainer.accelerator.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x):
        return (x * mask).sum(-1) / mask.sum(-1)

    if trainer.beta != 0.0:
        metrics["kl"].append(global_masked_mean(stats.kl))
    metrics["entropy"].append(global_masked_mean(stats.entropy))
    ratio = stats.ratio
    if _LOSS_TYPES[trainer.loss_type] == "clip":
        if trainer.args.delta is not None:
            ratio = torch.clamp(ratio, max=trainer.args.delta)
        low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(((low + high) > 0).float()))
        metrics["clip_ratio/low_min"].append(
            nanmin(trainer.accelerator.gather(masked_seq_mean(low))).item())
        metrics["clip_ratio/high_max"].append(
            nanmax(trainer.accelerator.gather(masked_seq_mean(high))).item())
    elif trainer.loss_type == "cispo":
        clipped = ((ratio > trainer.epsilon_high) & (advantages > 0)).float()
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))


# ----------------------------------------------------------------------------------------
# SFTTrainer's loss through linear_cross_entropy

def _sft_loss(trainer, model, inputs, return_outputs, num_items_in_batch, accumulator):
    """SFTTrainer.compute_loss, for the configurations _unsupported_sft() lets through:
    one forward with the head capturing its input, then the cross entropy in three
    GEMMs, its token statistics giving TRL's metrics."""
    if return_outputs or "shift_labels" in inputs:
        why = ("return_outputs=True (the logits are asked for)" if return_outputs else
               "pre-shifted labels (shift_labels)")
        warnings.warn(f"torch_fce.integrations.trl: TRL's own loss computes this batch: "
                      f"{why}", stacklevel=3)
    if return_outputs or "shift_labels" in inputs or _multimodal(trainer, inputs):
        return type(trainer).compute_loss(trainer, model, inputs, return_outputs,
                                          num_items_in_batch)
    args = trainer.args
    mode = "train" if trainer.model.training else "eval"
    # TRL's forward arguments, without editing the caller's batch
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    kwargs["use_cache"] = False
    if trainer.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    # Only the tokens with a label reach the head (prompts and padding cost no GEMM):
    # their count is read on the host while the GPU runs the model's forward.
    target = shift_targets(inputs["labels"], -100).flatten()
    labelled = target != -100
    n, count = _count_on_host(labelled)
    hidden, weight, bias, softcap, out = _head_inputs(model, **kwargs)
    target, labelled, n = (t.to(hidden.device) for t in (target, labelled, n))
    kept = torch.argsort(labelled.to(torch.uint8), descending=True, stable=True)[:count()]
    hidden, target = hidden.flatten(0, -2).index_select(0, kept), target[kept]
    dft = args.loss_type == "dft"
    # TRL smooths the nll loss only (its dft ignores label_smoothing_factor)
    eps = args.label_smoothing_factor if trainer.label_smoother is not None and not dft \
        else 0.0
    # head_bound: the peak of the head it replaces, TRL's, at most
    loss, stats = linear_cross_entropy(
        hidden, weight, target, bias, softcap=softcap, reduction="sum", label_smoothing=eps,
        dft=dft, return_stats=True, accumulator=accumulator, head_bound=True)
    del hidden  # the op keeps no operand for its backward
    if eps > 0.0:  # transformers' LabelSmoother: its denominator is not clamped
        den = n if num_items_in_batch is None else num_items_in_batch
    else:  # TRL's: clamped, so a batch without trainable tokens gives 0
        den = torch.as_tensor(n if num_items_in_batch is None
                              else num_items_in_batch).clamp(min=1)
    loss = loss / (den.to(loss.device) if isinstance(den, torch.Tensor) else den)
    if args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled and eps == 0.0:  # TRL's smoothed loss has no aux loss
        steps = trainer.current_gradient_accumulation_steps \
            if num_items_in_batch is not None else 1
        loss = loss + trainer.router_aux_loss_coef * out.aux_loss.to(loss.device) / steps
    _log_sft_metrics(trainer, mode, inputs, n, stats, target, out)
    return loss


def _count_on_host(mask):
    """(mask.sum(), count): count() gives the sum as a host int, its copy queued now (on
    CUDA into pinned memory, so later work is queued before the host waits for it)."""
    total = mask.sum()
    if total.device.type != "cuda":
        return total, lambda: int(total)
    host = torch.empty((), dtype=total.dtype, pin_memory=True)
    host.copy_(total, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def count():
        done.synchronize()
        return int(host)
    return total, count


def _log_sft_metrics(trainer, mode, inputs, n, stats, target, out):
    """The metrics SFTTrainer.compute_loss logs, from the loss's token statistics (n
    tokens, those with a label)."""
    acc, metrics = trainer.accelerator, trainer._metrics[mode]
    num_valid = acc.gather_for_metrics(n).sum()
    entropy_sum = acc.gather_for_metrics(stats.entropy.sum()).sum()
    num_correct = acc.gather_for_metrics((stats.argmax == target).sum()).sum()
    metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(
        (num_correct / num_valid).item() if num_valid > 0 else 0.0)
    if mode == "train":  # TRL's token count: the attention mask's, or the packed row's
        if "attention_mask" in inputs:
            n = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        elif "position_ids" in inputs:
            ids = inputs["position_ids"]
            n = acc.gather_for_metrics(torch.tensor(ids.size(1), device=ids.device)).sum().item()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        trainer._total_train_tokens += n // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(acc.gather_for_metrics(out.aux_loss).mean().item())


# ----------------------------------------------------------------------------------------
# DistillationTrainer and TRL's chunked divergence

def _distill_loss(trainer, unwrapped_student, inputs, num_items_in_batch, accumulator):
    """DistillationTrainer._compute_loss, TRL's own (hidden states, heads, scales,
    softcaps, masks), with its module's divergence call served by
    chunked_divergence_loss for the length of the call."""
    from trl.trainer import distillation_trainer as module

    trl_fn = module._chunked_divergence_loss

    def served(*args, **kwargs):
        return chunked_divergence_loss(*args, **kwargs, accumulator=accumulator,
                                       fallback=trl_fn)

    module._chunked_divergence_loss = served
    try:
        return type(trainer)._compute_loss(trainer, unwrapped_student, inputs,
                                           num_items_in_batch)
    finally:
        module._chunked_divergence_loss = trl_fn


def _full(t, dtype):
    """A DTensor head gathered as TRL's divergence does (FSDP2), else t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor().to(dtype) if isinstance(t, DTensor) else t


def chunked_divergence_loss(student_hidden_states, teacher_hidden_states,
                            student_lm_head_weight, teacher_lm_head_weight, completion_mask,
                            beta, num_items_in_batch=None, student_lm_head_bias=None,
                            teacher_lm_head_bias=None, student_logit_scale=1.0,
                            teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                            teacher_final_logit_softcapping=None, temperature=1.0, *,
                            accumulator="fp32", fallback=None):
    """A drop-in for TRL 1.16's `trl.trainer.distillation_trainer._chunked_divergence_loss`:
    (loss, entropy sum, valid-token count) of the generalized JSD over the tokens whose
    completion_mask is not 0, summed over num_items_in_batch (or the local mean), from
    linear_distillation_loss in four GEMMs with no host sync (the masked tokens weigh 0
    instead of being compacted). A logit scale that is not > 0 (TRL keeps a 0) goes to
    `fallback` (TRL's function) with a warning, or raises without one."""
    scales = (("student_logit_scale", student_logit_scale),
              ("teacher_logit_scale", teacher_logit_scale))
    for name, scale in scales:
        if not scale > 0:
            why = f"{name}={scale!r} (linear_distillation_loss takes scales > 0)"
            if fallback is None:
                raise ValueError(f"torch_fce does not serve {why}")
            warnings.warn(f"torch_fce.integrations.trl: TRL's own divergence computes this "
                          f"batch: {why}", stacklevel=3)
            return fallback(student_hidden_states, teacher_hidden_states,
                            student_lm_head_weight, teacher_lm_head_weight, completion_mask,
                            beta, num_items_in_batch, student_lm_head_bias,
                            teacher_lm_head_bias, student_logit_scale, teacher_logit_scale,
                            student_final_logit_softcapping,
                            teacher_final_logit_softcapping, temperature)
    hs, ht = student_hidden_states, teacher_hidden_states
    ws, bs = (None if t is None else _full(t, hs.dtype)
              for t in (student_lm_head_weight, student_lm_head_bias))
    wt, bt = (None if t is None else _full(t, ht.dtype)
              for t in (teacher_lm_head_weight, teacher_lm_head_bias))
    valid = completion_mask.reshape(hs.shape[:-1]) != 0
    n_valid = valid.sum()
    den = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(den, torch.Tensor):
        den = den.to(hs.device)
    weights = valid.to(torch.promote_types(hs.dtype, torch.float32)) / den
    loss, stats = linear_distillation_loss(
        hs, ws, ht, wt, None, bs, bt, beta=beta, temperature=temperature,
        token_weights=weights, logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, softcap=student_final_logit_softcapping,
        teacher_softcap=teacher_final_logit_softcapping, accumulator=accumulator)
    return loss, torch.where(valid, stats.entropy, 0.0).sum(), n_valid


class ChunkedDivergenceFunction:
    """A drop-in for `trl.kernels.chunked_divergence.ChunkedDivergenceFunction`: the same
    `apply` arguments and outputs, the per-token divergence (differentiable w.r.t. the
    student's hidden states, weight and bias) and the student's entropy (no gradient),
    float32 logits as TRL's. The forward runs linear_distillation_loss's two forward
    GEMMs; the backward runs it again with the upstream gradient as token weights (four
    GEMMs: six in all, where TRL's kernel runs six, or eight for the JSD). A loss whose
    upstream gradient is a scalar is cheaper through linear_distillation_loss itself
    (four GEMMs, token_weights for the reduction)."""

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
              teacher_bias, beta, temperature=1.0, student_logit_scale=1.0,
              student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None, accumulator="fp32"):
        opts = dict(beta=beta, temperature=temperature, logit_scale=student_logit_scale,
                    teacher_logit_scale=teacher_logit_scale,
                    softcap=student_final_logit_softcapping,
                    teacher_softcap=teacher_final_logit_softcapping, accumulator=accumulator)
        # TRL computes in autocast's dtype. Cast here, outside the recomputing backward
        # (which runs where the caller calls backward, usually after autocast has
        # exited): the backward then differentiates the loss the forward computed.
        student = autocast_operands(student_hidden, student_weight, student_bias)
        teacher = autocast_operands(teacher_hidden, teacher_weight, teacher_bias)
        return _Divergence.apply(*student, *teacher, opts)


class _Divergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, ht, wt, bt, opts):
        with torch.no_grad():
            _, stats = linear_distillation_loss(h, w, ht, wt, None, b, bt, **opts)
        ctx.save_for_backward(h, w, b, ht, wt, bt)
        ctx.opts = opts
        entropy = stats.entropy.float()  # float32, as TRL's
        ctx.mark_non_differentiable(entropy)
        return stats.divergence.float(), entropy

    @staticmethod
    def backward(ctx, grad_divergence, _):
        h, w, b, ht, wt, bt = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        if grad_divergence is None or not any(wanted):
            return (None,) * 7
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip((h, w, b), wanted)]
        weights = grad_divergence.to(torch.promote_types(h.dtype, torch.float32))
        with torch.enable_grad():
            loss, _ = linear_distillation_loss(leaves[0], leaves[1], ht, wt, None, leaves[2],
                                               bt, token_weights=weights, **ctx.opts)
            asked = [t for t, need in zip(leaves, wanted) if need]
            got = iter(torch.autograd.grad(loss, asked))
        return (*(next(got) if need else None for need in wanted), None, None, None, None)

"""GRPOTrainer's loss through linear_policy_loss: what it refuses, the loss with TRL's
normalisation, and the metrics TRL logs; and apply(match_sampler=True)'s old-log-prob
pass (the vLLM importance-sampling weight from the sampler's truncated distribution)."""

import warnings

import torch

from ...extension import sampler_and_model_logprobs
from ...functional import linear_policy_loss
from .common import _forward_grads_refusal, _head_inputs, _multimodal

_LOSS_TYPES = {"grpo": "clip", "dapo": "clip", "dr_grpo": "clip", "bnpo": "clip",
               "cispo": "cispo", "sapo": "sapo"}


def unsupported(trainer):
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


def loss(trainer, model, inputs, *, accumulator):
    """GRPOTrainer._compute_loss, for the configurations unsupported() lets through."""
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


# ---- apply(match_sampler=True): the importance-sampling weight of vLLM's truncation --

def sampler_truncation(trainer):
    """The truncation of the trainer's vLLM sampling as linear_logprobs takes it (TRL's
    top_k 0 and top_p 1 turn theirs off, as vLLM's -1 / 0 and 1 do), or None."""
    top_k = trainer.top_k if trainer.top_k is not None and trainer.top_k > 0 else None
    top_p = trainer.top_p if trainer.top_p is not None and trainer.top_p < 1.0 else None
    min_p = trainer.min_p if trainer.min_p else None
    if top_k is None and top_p is None and min_p is None:
        return None
    return dict(top_k=top_k, top_p=top_p, min_p=min_p)


def match_sampler_refusal(trainer):
    """Why apply(match_sampler=True) cannot give this trainer's vLLM importance-sampling
    weight the sampler's log-probs, or None."""
    from trl import GRPOTrainer

    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return "the trainer has no vLLM importance-sampling correction"
    if sampler_truncation(trainer) is None:
        return "its generation truncates nothing (top_k 0, top_p 1, no min_p)"
    if type(trainer)._generate_and_score_completions is not \
            GRPOTrainer._generate_and_score_completions:
        return "a subclass overrides _generate_and_score_completions"
    if trainer.repetition_penalty != 1.0:
        return ("repetition_penalty != 1 (vLLM's processed log-probs include the penalty, "
                "which depends on each sequence's tokens)")
    if trainer.args.generation_kwargs or trainer.args.vllm_structured_outputs_regex:
        return ("generation_kwargs or a structured-outputs regex (they may change the "
                "distribution vLLM samples from)")
    return None


def sampler_patches(trainer):
    """{method: replacement} apply(match_sampler=True) sets on the instance: the
    generation step, whose old-log-prob pass (TRL 1.16 runs it first of the step's
    log-prob passes when vLLM's importance-sampling correction is on) gives TRL the
    sampler's truncated log-probs, so its importance-sampling weight and its logged
    sampling/* metrics compare vLLM's processed log-probs with the same distribution,
    and then hands the step's inputs the untruncated ones from the same pass, so the
    PPO ratio keeps TRL's."""
    cls = type(trainer)
    truncation = sampler_truncation(trainer)
    state = {}

    def generate(*args, **kwargs):
        state.clear()
        state["pass"] = "old"
        try:
            output = cls._generate_and_score_completions(trainer, *args, **kwargs)
        finally:
            state.pop("pass", None)
        if "untruncated" in state:
            output["old_per_token_logps"] = state.pop("untruncated")
        return output

    def logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
              compute_entropy=False, compute_aux_loss=False, **model_inputs):
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size,
                compute_entropy, compute_aux_loss)
        if state.pop("pass", None) != "old":
            return cls._get_per_token_logps_and_entropies(trainer, *args, **model_inputs)
        if compute_entropy or compute_aux_loss or any(
                v is not None for v in model_inputs.values()):
            warnings.warn("torch_fce.integrations.trl.apply(match_sampler=True): a vision "
                          "batch: its importance-sampling weight keeps TRL's untruncated "
                          "log-probs", stacklevel=2)
            return cls._get_per_token_logps_and_entropies(trainer, *args, **model_inputs)
        truncated, untruncated = [], []
        step = batch_size or input_ids.size(0)
        for start in range(0, input_ids.size(0), step):  # TRL's batches of the pass
            ids = input_ids[start:start + step]
            with trainer.accelerator.autocast():
                hidden, weight, bias, softcap, _ = _head_inputs(
                    model, logits_to_keep, input_ids=ids,
                    attention_mask=attention_mask[start:start + step], use_cache=False)
            t, u = sampler_and_model_logprobs(
                hidden, weight, ids[:, -logits_to_keep:].to(hidden.device), bias,
                temperature=trainer.temperature, softcap=softcap, **truncation)
            truncated.append(t)
            untruncated.append(u)
        state["untruncated"] = torch.cat(untruncated)
        return torch.cat(truncated), None, None

    return {"_generate_and_score_completions": generate,
            "_get_per_token_logps_and_entropies": logps}

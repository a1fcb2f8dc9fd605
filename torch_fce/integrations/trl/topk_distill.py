"""TRL 1.16's experimental top-k distillation trainers through linear_sparse_divergence:
ServerDistillationTrainer's compute_loss (its sparse losses from the student's hidden
states, not its logits) and AsyncDistillationTrainer's _compute_loss (TRL's own, its
chunked sparse divergence served)."""

import math
import warnings

import torch

from ...distillation import linear_sparse_divergence
from .common import _forward_grads_refusal, _head_inputs, _multimodal

_SERVER_METHODS = ("compute_loss", "_compute_prompt_length", "_reduce_divergence_loss",
                   "_get_reverse_kl_top_1_tokens", "_compute_server_forward_kl_loss",
                   "_compute_server_sparse_top_1_divergence_loss",
                   "_compute_sparse_top_1_divergence_loss")
_ASYNC_METHODS = ("compute_loss", "_compute_loss")
_OP = "linear_sparse_divergence"
_SKIP = -1  # the support entries not read (no class id is negative)


def unsupported_server(trainer):
    """Why torch_fce cannot reproduce this ServerDistillationTrainer's loss, or None."""
    from trl.experimental.server_distillation import ServerDistillationTrainer

    why = _forward_grads_refusal(trainer, ServerDistillationTrainer, _SERVER_METHODS, _OP)
    if why is None and trainer.reverse_kl_top_1_mode != "sampled":
        why = (f"reverse_kl_top_1_mode={trainer.reverse_kl_top_1_mode!r} (the student's "
               f"argmax needs its logits)")
    return why


def unsupported_async(trainer):
    """Why torch_fce cannot reproduce this AsyncDistillationTrainer's loss, or None."""
    from trl.experimental.async_distillation import AsyncDistillationTrainer

    return _forward_grads_refusal(trainer, AsyncDistillationTrainer, _ASYNC_METHODS, _OP)


def server_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None, *,
                accumulator):
    """ServerDistillationTrainer.compute_loss: the same teacher request, window, support,
    normalisation and checks as TRL's, the student's log-probs from its hidden states
    through linear_sparse_divergence (TRL forms the full (B, T, V) log-softmax)."""
    if return_outputs or _multimodal(trainer, inputs):
        if return_outputs:
            warnings.warn("torch_fce.integrations.trl: return_outputs=True asks for the "
                          "logits: TRL's own loss computes this batch", stacklevel=3)
        return type(trainer).compute_loss(trainer, model, inputs, return_outputs,
                                          num_items_in_batch)
    # TRL's layout of the batch (ServerDistillationTrainer.compute_loss)
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = torch.cat([torch.full_like(prompt_ids, -100),
                        torch.where(completion_mask.bool(), completion_ids, -100)], dim=1)
    inputs = {**inputs, "input_ids": input_ids, "attention_mask": attention_mask,
              "labels": labels, "prompt_attention_mask": prompt_mask}
    hidden, weight, bias, softcap, _ = _head_inputs(model, input_ids=input_ids,
                                                    attention_mask=attention_mask)
    start = trainer._compute_prompt_length(inputs)
    teacher = trainer._get_teacher_token_logprobs_from_server(inputs, start)
    window = teacher["actual_logprobs"].shape[1]
    # position t of the window predicts completion token t: hidden state start - 1 + t
    hidden = hidden[:, start - 1:-1][:, :window]
    labels = labels[:, start:][:, :window]
    tokens = input_ids[:, start:][:, :window]
    counted = labels != -100
    support, teacher_lp = _server_support(trainer, teacher, tokens, counted)
    weights = counted.double() / counted.sum().clamp_min(1)  # TRL's exact mean's weights
    if trainer.model.training:  # TRL's: its local mean is not scaled by HF
        weights = weights / trainer.current_gradient_accumulation_steps
    loss, _ = linear_sparse_divergence(
        hidden, weight, support, teacher_lp, bias, beta=trainer.beta,
        tail=trainer.loss_add_tail, temperature=trainer.temperature, softcap=softcap,
        token_weights=weights, ignore_index=_SKIP, accumulator=accumulator)
    return loss


def _server_support(trainer, teacher, tokens, counted):
    """(support, teacher log-probs) of TRL's server losses: beta 0 the teacher's top-k
    (an entry of log-prob -inf, the server's padding, not read); beta 1 the sampled
    token; between, the teacher's top-1 and the sampled token (not read twice). The
    tokens not counted read nothing; TRL's checks of the teacher's values, as its."""
    top_ids, top_lp = teacher["topk_token_ids"], teacher["topk_logprobs"]
    if trainer.beta == 0:
        return top_ids, top_lp
    actual = teacher["actual_logprobs"]
    needed = [("actual-token", "reverse", actual)] + \
        ([("top-1", "forward", top_lp[..., 0])] if trainer.beta < 1 else [])
    for name, kind, values in needed:  # TRL's own checks (and host syncs)
        missing = counted & ~torch.isfinite(values)
        if missing.any():
            raise ValueError(f"Teacher server is missing {name} logprobs for required "
                             f"{kind}-KL positions: {int(missing.sum())}/"
                             f"{int(counted.sum())}.")
    if trainer.beta == 1:
        support, lp = tokens[..., None], actual[..., None]
    else:
        top1 = top_ids[..., 0]
        support = torch.stack([top1, torch.where(tokens != top1, tokens, _SKIP)], -1)
        lp = torch.stack([top_lp[..., 0], actual], -1)
    return torch.where(counted[..., None], support, _SKIP), lp


def async_loss(trainer, unwrapped_model, inputs, *, accumulator):
    """AsyncDistillationTrainer._compute_loss, TRL's own (support narrowing, token mask,
    normaliser, metrics), with its module's chunked sparse divergence served by
    chunked_jsd_loss for the length of the call."""
    from trl.experimental.async_distillation import async_distillation_trainer as module

    trl_fn = module._chunked_jsd_loss

    def served(*args):
        return chunked_jsd_loss(*args, accumulator=accumulator)

    module._chunked_jsd_loss = served
    try:
        return type(trainer)._compute_loss(trainer, unwrapped_model, inputs)
    finally:
        module._chunked_jsd_loss = trl_fn


def chunked_jsd_loss(hidden, weight, bias, logit_scale, softcap, target_ids, teacher_lp,
                     valid, beta, temperature, add_tail_bucket, teacher_idx, num_teachers,
                     chunk_size, *, accumulator="fp32"):
    """A drop-in for TRL 1.16's async distillation `_chunked_jsd_loss`: (loss, jsd sum,
    student entropy sum, teacher entropy sum, per-teacher (count, jsd sum, teacher
    entropy sum)) over the valid positions, from linear_sparse_divergence in three
    GEMMs (chunk_size: torch_fce's workspace chunks instead). As TRL's, in float32 (the
    operands promoted to one dtype: bf16 ones stay bf16 with float32 logits, which are
    TRL's float32 products) and unscaled by autocast."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if bias is not None:
        dtype = torch.promote_types(dtype, bias.dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        loss, stats = linear_sparse_divergence(
            hidden.to(dtype), weight.to(dtype), torch.where(valid, target_ids, _SKIP),
            teacher_lp.to(torch.float32), None if bias is None else bias.to(dtype),
            beta=beta, tail=add_tail_bucket, temperature=temperature,
            logit_scale=logit_scale, softcap=softcap,
            token_weights=torch.ones(hidden.shape[0], device=hidden.device),
            ignore_index=_SKIP, accumulator=accumulator)
    with torch.no_grad():
        teacher_entropy = _teacher_entropy(teacher_lp.float(), valid, add_tail_bucket)
        per_teacher = loss.new_zeros(3 * num_teachers)
        if teacher_idx is not None:  # per teacher: (count, jsd sum, entropy sum)
            of = torch.arange(num_teachers, device=teacher_idx.device)[:, None] == teacher_idx
            per_teacher = torch.stack([
                of.sum(-1).float(), torch.where(of, stats.divergence, 0.0).sum(-1),
                torch.where(of, teacher_entropy, 0.0).sum(-1)], -1).reshape(-1)
    return (loss, stats.divergence.sum(), stats.entropy.sum(), teacher_entropy.sum(),
            per_teacher)


def _teacher_entropy(lp, valid, tail):
    """Each token's entropy of the teacher's sparse distribution as TRL's async trainer
    logs it: over the support's valid entries, with the tail bucket or renormalised."""
    lp = torch.where(valid, lp, -math.inf)
    if tail:
        log_sum = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
        lp = torch.cat([lp, torch.log(-torch.expm1(log_sum))], -1)
        valid = torch.cat([valid, torch.ones_like(valid[..., :1])], -1)
    else:
        lp = lp - torch.logsumexp(lp, -1, keepdim=True)
    p = torch.where(valid, lp.exp(), 0.0)
    return torch.nan_to_num(-(p * torch.where(valid, lp, 0.0)).sum(-1), nan=0.0)

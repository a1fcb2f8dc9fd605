"""DistillationTrainer's loss through linear_distillation_loss (TRL's own _compute_loss
with its divergence call served), and the drop-ins for TRL's chunked divergence
(chunked_divergence_loss, ChunkedDivergenceFunction)."""

import warnings

import torch

from ...extension import autocast_operands
from ...distillation import linear_distillation_loss
from .common import _forward_grads_refusal


def unsupported(trainer):
    """Why torch_fce cannot reproduce this DistillationTrainer's loss exactly, or None."""
    from trl import DistillationTrainer

    return _forward_grads_refusal(trainer, DistillationTrainer,
                                  ("compute_loss", "_compute_loss"),
                                  "linear_distillation_loss")


def loss(trainer, unwrapped_student, inputs, num_items_in_batch=None, *, accumulator):
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

"""The result types of torch_fce's functions, below everything that returns them
(functional.py, distillation.py, distributed/), so that no module imports its caller for a type."""

from typing import NamedTuple, Optional

import torch


class LossStats(NamedTuple):
    """Token statistics of linear_cross_entropy(return_stats=True), from the loss's own
    pass: lse, argmax (int64, the most likely class) and entropy (-sum_c p_c log p_c of
    the softcapped logits) of target's shape, for every token (ignored ones too), and
    z_loss, the z-loss term's share of the loss (reduced as the loss; 0 without
    z_loss). None carries a gradient."""
    lse: torch.Tensor
    argmax: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor


class LogProbs(NamedTuple):
    """linear_logprobs' outputs, each of target's shape (float32; float64 for float64
    inputs; argmax int64). entropy is None unless asked for; lse and argmax carry no
    gradient."""
    logprob: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    argmax: torch.Tensor


class PolicyStats(NamedTuple):
    """linear_policy_loss' per-token statistics, each of target's shape, float32
    (float64 for float64 inputs), detached, 0 at ignored tokens: the log-prob and
    entropy at the temperature, the importance ratio exp(logprob - old_logprobs) (1
    without old log-probs), whether the token's policy term was clipped (1.0 / 0.0), and
    the KL estimate to the reference (0 without ref_logprobs)."""
    logprob: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


class SparseDivergenceStats(NamedTuple):
    """linear_sparse_divergence's per-token statistics, each of the tokens' shape,
    float32 (float64 for float64 inputs), detached, 0 at tokens not counted: the
    divergence over the support, the student's probability mass on the support's valid
    entries and the entropy of the student's whole distribution (at its temperature)."""
    divergence: torch.Tensor
    student_mass: torch.Tensor
    entropy: torch.Tensor


class TopKLogprobs(NamedTuple):
    """linear_topk_logprobs' outputs, detached: per token the k most likely classes
    (int64, by probability descending, equal ones by ascending class) and their
    log-probs, each (*, k), and the target's log-prob (*) (None without a target; 0 at
    ignored targets); float32 (float64 for float64 inputs)."""
    indices: torch.Tensor
    logprobs: torch.Tensor
    target_logprob: Optional[torch.Tensor]


class DistillationStats(NamedTuple):
    """linear_distillation_loss' per-token statistics, each of the tokens' shape, float32
    (float64 for float64 inputs), detached, 0 at tokens not counted: the divergence
    between student and teacher (beta's) and the student's entropy at the temperature."""
    divergence: torch.Tensor
    entropy: torch.Tensor

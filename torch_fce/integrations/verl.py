"""verl: torch_fce's log-probs and entropies behind verl's fused-kernel entry point.

    from torch_fce.integrations import verl as fce_verl
    fce_verl.apply()     # in every worker, before verl builds its actor
    ...                  # verl with use_fused_kernels=True, impl_backend=triton
    fce_verl.revert()

verl's fused forward (`actor_rollout_ref.model.use_fused_kernels=True` with
`actor_rollout_ref.model.fused_kernel_options.impl_backend=triton`) calls
`verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels,
temperature, reduction, dist_process_group)`; apply() puts `linear_cross_entropy` below
in its place (its HF models look it up at each call; a module that imported the name
before apply() keeps verl's).
"""

import importlib

import torch

from ..distributed.vocab_parallel import vocab_parallel_linear_logprobs
from ..extension import check_options
from ..functional import linear_logprobs

_MODULE = "verl.utils.kernel.linear_cross_entropy"
_THEIRS = "_torch_fce_verl_original"
_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                         dist_process_group=None, *, accumulator="fp32"):
    """verl's fused kernel's call, from torch_fce.linear_logprobs: (logprobs, entropy)
    of softmax((hidden @ weight.T) / temperature) at labels, the logits kept in float32
    from the GEMM as verl's kernel keeps them (logits_dtype=torch.float32).

    Args:
        hidden: (*, D), its tokens in labels' order once both are flattened (as verl's
            kernel pairs them: Megatron passes hidden (s, 1, D) with labels (1, s)).
        weight: (V, D), or with dist_process_group this rank's rows of a
            head split in equal, contiguous shards across the group (rank r holds rows
            [r V, (r + 1) V), as Megatron pads and splits it); hidden and labels the
            same on every rank.
        labels: (*) int64, -100 to skip (log-prob 0; the entropy is still the token's).
        reduction: "none" (per token), "sum" or "mean" (of the log-probs over the tokens
            not skipped; the entropy stays per token, as verl's kernel returns it).

    Returns:
        (logprobs, entropy) float32 (float64 for float64 inputs), of labels' shape where
        hidden's leading shape is labels' (verl's HF callers: the packed path squeezes
        dim 0, the padded one slices (B, T)), else flat (N,) as verl's kernel returns
        them. Both differentiable w.r.t. hidden and weight, for any upstream gradients,
        at any V.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if hidden.shape[:-1].numel() != labels.numel():
        raise ValueError(f"labels must have one label per token of hidden "
                         f"({hidden.shape[:-1].numel()}), got shape {tuple(labels.shape)}")
    shape = labels.shape if hidden.shape[:-1] == labels.shape else (labels.numel(),)
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    # The entropy of every token, skipped ones included (as verl's reference): scored at
    # class 0, their log-probs then masked out.
    valid = labels != -100
    scored = labels.masked_fill(~valid, 0)
    if dist_process_group is None:
        out = linear_logprobs(hidden, weight, scored, temperature=temperature, entropy=True,
                              accumulator=accumulator, logits_dtype=torch.float32)
    else:
        rank = torch.distributed.get_rank(dist_process_group)
        world = torch.distributed.get_world_size(dist_process_group)
        local = weight.shape[0]
        out = vocab_parallel_linear_logprobs(
            hidden, weight, scored, vocab_start=rank * local, vocab_size=world * local,
            group=dist_process_group, temperature=temperature, entropy=True,
            accumulator=accumulator, logits_dtype=torch.float32)
    logprobs = torch.where(valid, out.logprob, 0.0)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / valid.sum()
    else:
        logprobs = logprobs.reshape(shape)
    return logprobs, out.entropy.reshape(shape)


def apply(accumulator="fp32"):
    """Makes verl's fused kernel entry point torch_fce's (process-wide, reversibly)."""
    check_options("linear_logprobs", accumulator=accumulator)
    module = importlib.import_module(_MODULE)
    if hasattr(module, _THEIRS):
        raise ValueError("torch_fce is already applied to verl")
    setattr(module, _THEIRS, module.linear_cross_entropy)

    def ours(hidden, weight, labels, temperature=1.0, reduction="none",
             dist_process_group=None):
        return linear_cross_entropy(hidden, weight, labels, temperature, reduction,
                                    dist_process_group, accumulator=accumulator)

    module.linear_cross_entropy = ours


def revert():
    """Undoes apply(): verl's own kernel again."""
    module = importlib.import_module(_MODULE)
    if not hasattr(module, _THEIRS):
        raise ValueError("torch_fce is not applied to verl")
    module.linear_cross_entropy = getattr(module, _THEIRS)
    delattr(module, _THEIRS)

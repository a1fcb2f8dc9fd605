"""torch_fce.linear_cross_entropy: the Python entry to fce::linear_ce."""

import torch

from .ops.checks import check_inputs, check_options
from .ops.linear_ce import int64_if_needed


def shift_targets(target, ignore_index):
    """Causal-LM shift: position t predicts target t+1; the last position is ignored."""
    pad = target.new_full((*target.shape[:-1], 1), ignore_index)
    return torch.cat([target[..., 1:], pad], dim=-1)


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None, *,
                         ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap=None, z_loss=0.0, accumulator="fp32", shift=False):
    """Cross entropy of F.linear(hidden, weight, bias) against target, without the logits.

    Args:
        hidden: (*, D) bfloat16, float16 or float32.
        weight: (V, D), hidden's dtype or float32 (master weights).
        target: (*) int64/int32 class indices; ignore_index marks tokens to skip.
        bias: optional (V,). class_weight: optional (V,), as `weight=` of F.cross_entropy.
        shift: pair hidden[..., t, :] with target[..., t + 1] (causal LM); hidden is not
            copied, the last position of each sequence is ignored.
        Other options: see API.md.
        A DTensor weight sharded on dim 0 (vocabulary) runs the vocab-parallel loss over
        its mesh dimension (torch_fce.distributed); the loss is the same on every rank.

    Returns:
        float32 loss: () for "mean"/"sum", target.shape for "none".
    """
    # Checked here too: the dispatcher's own type errors would not name the option.
    check_options(reduction, label_smoothing, softcap, z_loss, accumulator, ignore_index)
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
    if shift:
        check_inputs(hidden, weight, target, bias, class_weight)
        if target.dim() == 0:
            raise ValueError("shift=True needs target with a sequence dimension, got a 0-d tensor")
        target = shift_targets(int64_if_needed(target, ignore_index), ignore_index)
    options = dict(ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                   accumulator=accumulator)
    if _is_dtensor(weight):  # sharded by vocabulary: the vocab-parallel loss
        from .distributed.dtensor import dtensor_linear_cross_entropy

        return dtensor_linear_cross_entropy(hidden, weight, target, bias, class_weight,
                                            **options)
    return torch.ops.fce.linear_ce(hidden, weight, target, bias, class_weight, **options)


def _is_dtensor(t):
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)

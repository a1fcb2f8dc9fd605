"""The reference semantics of fce::linear_ce as a plain composition (docs/api.md).

Used by tests and benchmarks as the independent oracle; materialises the logits.
"""

import torch
import torch.nn.functional as F


def logits_ce_reference(z, target, class_weight=None, *, ignore_index=-100,
                        reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
    """F.cross_entropy (+ softcap, + z-loss) of logits z (N, V) in z's dtype."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = target.long()
    cw = None if class_weight is None else class_weight.to(z.dtype)
    loss = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss > 0.0:
        valid = t != ignore_index
        zl = torch.where(valid, torch.logsumexp(z, -1) ** 2, 0.0) * z_loss
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / valid.sum()}[reduction]
    return loss


def linear_ce_reference(hidden, weight, target, bias=None, class_weight=None, *,
                        products_dtype=None, math_dtype=torch.float64, **options):
    """F.linear + F.cross_entropy (+ z-loss) with math in math_dtype.

    products_dtype: run F.linear in this dtype and round the logits to it before the
    math (what the op does with low-precision inputs); None runs it in math_dtype.
    hidden (*, D), weight (V, D), target (*). Returns () or target.shape.
    """
    pd = products_dtype or math_dtype
    b = None if bias is None else bias.to(pd)
    z = F.linear(hidden.to(pd), weight.to(pd), b).to(math_dtype)
    loss = logits_ce_reference(z.reshape(-1, weight.shape[0]), target.reshape(-1),
                               class_weight, **options)
    return loss.reshape(target.shape) if options.get("reduction") == "none" else loss

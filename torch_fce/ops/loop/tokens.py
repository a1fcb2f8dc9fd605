"""Per-token scalars: gradient scales for each reduction and the final loss reduction.

The kernels work on one token row at a time and produce per-token terms; everything
that couples tokens (the "mean" denominators) lives here, as O(N) tensor math, so no
value ever has to travel to the host.
"""

import torch


def target_weights(target, class_weight, ignore_index, dtype):
    """Returns (valid (N,) bool, w_y (N,) dtype: class weight of each counted target)."""
    valid = target != ignore_index
    if class_weight is None:
        return valid, valid.to(dtype)
    safe = torch.where(valid, target, 0).long().clamp(0, class_weight.shape[0] - 1)
    return valid, torch.where(valid, class_weight.to(dtype)[safe], 0.0)


def token_weights(token_weights, valid, dtype):
    """w_t of the scalar losses that weigh tokens (policy, distillation): the given
    weights, or 1 / (number of tokens not ignored) (1 when none is)."""
    if token_weights is not None:
        return token_weights.to(dtype)
    return valid.to(dtype) / valid.sum().clamp_min(1).to(dtype)


def counted_target_weights(target, class_weight, ignore_index, V, dtype):
    """target_weights for the row math: NaN where a counted target is outside [0, V).

    Off the CPU targets are not range-checked by default (a host sync): as in the Triton
    kernel, such a token's loss is NaN and nothing is read out of bounds.
    """
    valid, w_y = target_weights(target, class_weight, ignore_index, dtype)
    return valid, torch.where(valid & ((target < 0) | (target >= V)), float("nan"), w_y)


def grad_scales(target, class_weight, opts, dtype, grad_loss=None):
    """d loss / d (per-token CE term) and d loss / d (per-token lse**2), each (N,) dtype,
    for the cross entropy's options record (ignore_index, reduction, z_loss are read).

    Ignored tokens get exactly 0, so their rows contribute nothing even when a "mean"
    denominator is 0. grad_loss, when given, is the upstream gradient (() or (N,)).
    """
    valid, w_y = target_weights(target, class_weight, opts.ignore_index, dtype)
    zero = torch.zeros((), dtype=dtype, device=target.device)
    if opts.reduction == "mean":
        ce = torch.where(valid, 1.0 / w_y.sum(), zero)
        zl = torch.where(valid, opts.z_loss / valid.sum().to(dtype), zero)
    else:
        ce = valid.to(dtype)
        zl = ce * opts.z_loss
    if grad_loss is not None:
        g = grad_loss.to(dtype)
        ce, zl = ce * g, zl * g
    return ce, zl


def z_loss_term(lse, valid, opts):
    """z_loss * lse**2 over the counted tokens, reduced as the loss is (per token for
    "none", 0 without z_loss, also when every token is ignored)."""
    term = torch.where(valid, lse * lse, 0.0) * opts.z_loss
    if opts.reduction == "none":
        return term
    if opts.reduction == "sum" or opts.z_loss == 0.0:
        return term.sum()
    return term.sum() / valid.sum()


def reduce_loss(nll, smooth, lse, target, class_weight, opts, V):
    """Combines per-token terms (N,) into the loss of docs/api.md's reference formula:
    (1 - eps) nll + (eps / V) smooth, reduced, plus the z-loss term.

    nll = w_y * (lse - z_y) and smooth = sum_c w_c * (lse - z_c), both 0 where ignored.
    """
    valid, w_y = target_weights(target, class_weight, opts.ignore_index, nll.dtype)
    eps = opts.label_smoothing
    ce = (1.0 - eps) * nll
    if eps > 0.0:
        ce = ce + (eps / V) * smooth
    if opts.reduction == "none":
        loss = ce
    elif opts.reduction == "sum":
        loss = ce.sum()
    else:
        loss = ce.sum() / w_y.sum()
    return loss if opts.z_loss == 0.0 else loss + z_loss_term(lse, valid, opts)

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


def grad_scales(target, class_weight, ignore_index, reduction, z_loss, dtype, grad_loss=None):
    """d loss / d (per-token CE term) and d loss / d (per-token lse**2), each (N,) dtype.

    Ignored tokens get exactly 0, so their rows contribute nothing even when a "mean"
    denominator is 0. grad_loss, when given, is the upstream gradient (() or (N,)).
    """
    valid, w_y = target_weights(target, class_weight, ignore_index, dtype)
    zero = torch.zeros((), dtype=dtype, device=target.device)
    if reduction == "mean":
        ce = torch.where(valid, 1.0 / w_y.sum(), zero)
        zl = torch.where(valid, z_loss / valid.sum().to(dtype), zero)
    else:
        ce = valid.to(dtype)
        zl = ce * z_loss
    if grad_loss is not None:
        g = grad_loss.to(dtype)
        ce, zl = ce * g, zl * g
    return ce, zl


def reduce_loss(nll, smooth, lse, target, class_weight, ignore_index, reduction,
                label_smoothing, z_loss, V):
    """Combines per-token terms (N,) into the loss of docs/api.md's reference formula.

    nll = w_y * (lse - z_y) and smooth = sum_c w_c * (lse - z_c), both 0 where ignored.
    """
    valid, w_y = target_weights(target, class_weight, ignore_index, nll.dtype)
    ce = (1.0 - label_smoothing) * nll
    if label_smoothing > 0.0:
        ce = ce + (label_smoothing / V) * smooth
    zl = torch.where(valid, lse * lse, 0.0) * z_loss if z_loss > 0.0 else None
    if reduction == "none":
        return ce if zl is None else ce + zl
    if reduction == "sum":
        return ce.sum() if zl is None else ce.sum() + zl.sum()
    loss = ce.sum() / w_y.sum()
    return loss if zl is None else loss + zl.sum() / valid.sum()


def temperature_tensor(temperature, target):
    """None for 1.0; a float > 0 as is checked here; a tensor broadcast to target."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if isinstance(temperature, torch.Tensor):
        try:
            return temperature.expand(target.shape)
        except RuntimeError:
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} does not "
                             f"broadcast to target's shape {tuple(target.shape)}") from None
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a tensor, got "
                        f"{type(temperature).__name__}")
    # NaN fails too. Under torch.compile the kernels check the values instead, as for a
    # temperature tensor (docs/api.md): raised here, Dynamo would drop the message.
    if not torch.compiler.is_compiling() and not 0.0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    if temperature == 1.0:
        return None
    # float64 holds the Python float exactly; the kernels take it to their math dtype.
    # Scaling a tensor keeps a compile-time symbolic float symbolic (no compile per value).
    return torch.ones(target.shape, device=target.device, dtype=torch.float64) * temperature


def advantages_tensor(advantages, target):
    """Per-sequence advantages ((B,) or (B, 1) for a (B, T) target) expanded to target's
    shape; anything else as given (the checks name a wrong shape)."""
    if isinstance(advantages, torch.Tensor) and isinstance(target, torch.Tensor) and \
            target.dim() == 2 and advantages.shape in ((target.shape[0],),
                                                      (target.shape[0], 1)):
        return advantages.reshape(-1, 1).expand(target.shape)
    return advantages


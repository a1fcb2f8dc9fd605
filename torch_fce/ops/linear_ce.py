"""fce::linear_ce and linear_ce_stats: validate, apply autocast, flatten and pick the
gradient strategy."""

import torch
import torch.autograd.forward_ad as fwAD

from .checks import check_inputs, check_options
from .chunked import autocast_enabled
from .schema import LIB


_NO_TRANSFORMS = (
    "torch_fce's ops (fce::linear_ce, fce::linear_logprobs) have no forward-mode "
    "derivative and no torch.func derivative "
    "(grad, jvp, jacrev, hessian, dual tensors; vmap of the forward alone runs): use "
    "torch.autograd (loss.backward() or torch.autograd.grad) for its gradients"
)


def _refuse_transforms(tensors):
    """Forward AD and functorch's derivatives would otherwise see a tangent of 0 or an
    internal error; vmap alone is served by torch's per-sample fallback."""
    if any(isinstance(t, torch.Tensor) and torch._C._functorch.is_gradtrackingtensor(t)
           for t in tensors):
        raise NotImplementedError(_NO_TRANSFORMS)
    if fwAD._current_level >= 0 and any(
            isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None
            for t in tensors):
        raise NotImplementedError(_NO_TRANSFORMS)


def int64_if_needed(target, ignore_index):
    """int32 targets compared with an ignore_index outside int32's range would wrap it
    around onto a real class: such an index matches no target, as with int64 ones."""
    if isinstance(target, torch.Tensor) and target.dtype == torch.int32 \
            and not -2**31 <= ignore_index < 2**31:
        return target.long()
    return target


def _autocast(hidden, weight, bias):
    """As F.linear under torch.autocast: products in the autocast dtype.

    A float32 weight stays float32 (master weights): the kernels run the products in
    hidden's dtype and sum its gradient in float32; a bias stays float32 with it.
    """
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, bias) if t is not None):
        return hidden, weight, bias  # check_inputs names the argument
    device = hidden.device.type
    if not autocast_enabled(device) or hidden.dtype == torch.float64:
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device)
    if weight.dtype != torch.float32:
        weight = weight.to(dtype)
    if bias is not None and bias.dtype not in (dtype, weight.dtype):
        bias = bias.to(dtype)
    return hidden.to(dtype), weight, bias


def _linear_ce(hidden, weight, target, bias, class_weight, ignore_index, reduction,
               label_smoothing, softcap, z_loss, accumulator, stats):
    """(loss, lse, argmax): the token statistics (0,) unless stats."""
    check_options(reduction, label_smoothing, softcap, z_loss, accumulator, ignore_index)
    _refuse_transforms((hidden, weight, bias, class_weight))
    hidden, weight, bias = _autocast(hidden, weight, bias)  # dtypes are checked after it
    check_inputs(hidden, weight, target, bias, class_weight)
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("class_weight must not require grad: its gradient is not computed "
                         "(as F.cross_entropy's weight); pass class_weight.detach()")
    target = int64_if_needed(target, ignore_index)
    # Scalar losses get their gradients in the forward (one GEMM fewer). Per-token losses
    # need the upstream gradient first, and so does float16, whose logits gradient would
    # underflow if rounded before a loss scale (GradScaler) is applied: both recompute
    # the logits in the backward.
    grad = torch.is_grad_enabled() and reduction != "none" and hidden.dtype != torch.float16
    needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    loss, *_, lse, argmax = torch.ops.fce.linear_ce_fwd(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, class_weight,
        ignore_index, reduction, label_smoothing, softcap, z_loss, accumulator, needs, stats)
    loss = loss.reshape(target.shape) if reduction == "none" else loss
    if stats:
        lse, argmax = lse.reshape(target.shape), argmax.reshape(target.shape)
    return loss, lse, argmax


@torch.library.impl(LIB, "linear_ce", "CompositeImplicitAutograd")
def linear_ce(hidden, weight, target, bias=None, class_weight=None, *, ignore_index=-100,
              reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0,
              accumulator="fp32"):
    return _linear_ce(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                      label_smoothing, softcap, z_loss, accumulator, False)[0]


@torch.library.impl(LIB, "linear_ce_stats", "CompositeImplicitAutograd")
def linear_ce_stats(hidden, weight, target, bias=None, class_weight=None, *,
                    ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                    z_loss=0.0, accumulator="fp32"):
    return _linear_ce(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                      label_smoothing, softcap, z_loss, accumulator, True)

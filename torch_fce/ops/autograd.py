"""Autograd formulas of the internal ops (the public op decomposes into them).

reduction "mean"/"sum": the forward already computed the gradients for a unit upstream
gradient, so the backward only scales them by the (scalar) upstream gradient. Saved
tensors are never modified, so retain_graph and repeated backwards stay correct.
reduction "none": the upstream gradient differs per token, so the backward recomputes
the logits chunk by chunk (fce::linear_ce_bwd).
"""

import torch

_NO_DOUBLE = (
    "fce::linear_ce does not support double backward (create_graph=True through the loss)"
)


def _setup_fwd(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, \
        softcap, z_loss, accumulator, needs_grad = inputs
    _, gh, gw, gb = output
    ctx.mark_non_differentiable(gh, gw, gb)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.reduction = reduction
    ctx.options = (ignore_index, label_smoothing, softcap, z_loss, accumulator)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)
    else:
        ctx.save_for_backward(gh, gw, gb)


def _backward_fwd(ctx, grad_loss, *_):
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        grads = _grads(ctx, grad_loss)
    if create_graph:
        # As torch.autograd.function.once_differentiable: the gradients are usable,
        # differentiating them once more raises.
        grads = [None if g is None else _delayed_error(g) for g in grads]
    return grads[0], grads[1], None, grads[2], None, None, None, None, None, None, None, None


def _delayed_error(t):
    t = t.detach().requires_grad_()  # the error node needs an input that requires grad
    return torch._C._functions.DelayedError(_NO_DOUBLE, 1)(t)


def _grads(ctx, grad_loss):
    needs = list(ctx.needs_input_grad[:2]) + [ctx.needs_input_grad[3]]
    if ctx.reduction == "none":
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        grads = torch.ops.fce.linear_ce_bwd(
            grad_loss, hidden, weight, target, bias, class_weight, *ctx.options, needs)
    else:
        grads = [
            (g * grad_loss).to(dtype) if need else None
            for g, dtype, need in zip(ctx.saved_tensors, ctx.dtypes, needs)
        ]
    return [g if need else None for g, need in zip(grads, needs)]


torch.library.register_autograd("fce::linear_ce_fwd", _backward_fwd, setup_context=_setup_fwd)

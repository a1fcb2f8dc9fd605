"""Autograd formulas of the internal ops (the public op decomposes into them).

When the forward computed the gradients (scalar losses, see linear_ce.py), the backward
only scales them by the scalar upstream gradient. Saved tensors are never modified, so
retain_graph and repeated backwards stay correct. Otherwise (reduction "none", float16
inputs) the backward recomputes the logits chunk by chunk with the upstream gradient
applied before anything is rounded (fce::linear_ce_bwd).
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
    ctx.set_materialize_grads(False)  # else autograd makes zero "gradients" of gh, gw, gb
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.precomputed = any(needs_grad)
    ctx.options = (ignore_index, reduction, label_smoothing, softcap, z_loss, accumulator)
    if ctx.precomputed:
        ctx.save_for_backward(gh, gw, gb)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)


def _backward_fwd(ctx, grad_loss, *_):
    if grad_loss is None:  # the loss got no gradient (grads are not materialised)
        return (None,) * 12
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
    if not ctx.precomputed:
        grads = torch.ops.fce.linear_ce_bwd(grad_loss, *ctx.saved_tensors, *ctx.options, needs)
    else:
        # Scaled and rounded in one pass: no float32 temporary of the weight's size.
        grads = [
            torch.ops.fce.scale_grad(g, grad_loss, dtype) if need else None
            for g, dtype, need in zip(ctx.saved_tensors, ctx.dtypes, needs)
        ]
    return [g if need else None for g, need in zip(grads, needs)]


torch.library.register_autograd("fce::linear_ce_fwd", _backward_fwd, setup_context=_setup_fwd)

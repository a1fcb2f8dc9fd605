"""Autograd formulas of the internal ops (the public ops decompose into them).

When the forward computed the gradients (scalar losses, see linear_ce.py), the backward
only scales them by the scalar upstream gradient. Saved tensors are never modified, so
retain_graph and repeated backwards stay correct. Otherwise (reduction "none", float16
inputs) the backward recomputes the logits chunk by chunk with the upstream gradient
applied before anything is rounded (fce::linear_ce_bwd). The inputs are saved in both
cases, so editing one in place before the backward raises torch's version-counter error
instead of returning stale gradients.
"""

import torch

_NO_DOUBLE = (
    "torch_fce's ops (fce::linear_ce, fce::linear_logprobs) do not support double "
    "backward: their gradients are first order (create_graph=True gives usable gradients "
    "that cannot be differentiated again)"
)


def _setup_fwd(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, \
        softcap, z_loss, accumulator, needs_grad, _ = inputs
    _, gh, gw, gb, lse, argmax = output
    ctx.mark_non_differentiable(gh, gw, gb, lse, argmax)
    ctx.set_materialize_grads(False)  # else autograd makes zero "gradients" of gh, gw, gb
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.precomputed = any(needs_grad)
    ctx.options = (ignore_index, reduction, label_smoothing, softcap, z_loss, accumulator)
    ctx.save_for_backward(hidden, weight, target, bias, class_weight,
                          *((gh, gw, gb) if ctx.precomputed else ()))


def _backward_fwd(ctx, grad_loss, *_):
    if grad_loss is None:  # the loss got no gradient (grads are not materialised)
        return (None,) * 13
    saved = ctx.saved_tensors  # raises if an input was modified in place since
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        grads = _grads(ctx, grad_loss, saved)
    if create_graph:
        grads = _first_order(grads, (grad_loss, *saved[:5]))
    return grads[0], grads[1], None, grads[2], *(None,) * 9


def _first_order(grads, inputs):
    """The gradients, usable; differentiating them once more (backward, grad, hvp, w.r.t.
    any input or upstream gradient) raises."""
    inputs = [t for t in inputs if t is not None]
    return [None if g is None else _OnceDifferentiable.apply(g, *inputs) for g in grads]


class _OnceDifferentiable(torch.autograd.Function):
    """grad itself, as a function of the op's inputs whose derivative raises.

    Inputs that do not require grad (an integer target) are passed but ignored."""

    @staticmethod
    def forward(ctx, grad, *inputs):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_NO_DOUBLE)


def _grads(ctx, grad_loss, saved):
    needs = list(ctx.needs_input_grad[:2]) + [ctx.needs_input_grad[3]]
    if not ctx.precomputed:
        grads = torch.ops.fce.linear_ce_bwd(grad_loss, *saved, *ctx.options, needs)
    else:
        grads = _scaled(saved[5:], grad_loss, ctx.dtypes, needs)
    return [g if need else None for g, need in zip(grads, needs)]


def _scaled(grads, grad_loss, dtypes, needs):
    """Gradients the forward formed for a unit upstream gradient, scaled by grad_loss and
    rounded to their dtypes in one pass (no float32 temporary of the weight's size)."""
    return [torch.ops.fce.scale_grad(g, grad_loss, dtype) if need else None
            for g, dtype, need in zip(grads, dtypes, needs)]


torch.library.register_autograd("fce::linear_ce_fwd", _backward_fwd, setup_context=_setup_fwd)


def _setup_logprobs(ctx, inputs, output):
    hidden, weight, target, bias, temperature, softcap, ignore_index, entropy, \
        accumulator = inputs
    ctx.mark_non_differentiable(*output[2:])  # lse, argmax, row_stats
    ctx.set_materialize_grads(False)
    ctx.options = (softcap, ignore_index, accumulator)
    ctx.entropy = entropy
    # The forward's row statistics spare the backward a statistics pass over the logits
    # (an internal output: the user cannot edit it in place).
    ctx.save_for_backward(hidden, weight, target, bias, temperature, output[4])


def _backward_logprobs(ctx, grad_logprob, grad_entropy, *_):
    """The logits are recomputed with both upstream gradients (log-probs and entropy
    are per token, so no gradient is formed in the forward)."""
    if not ctx.entropy:
        grad_entropy = None
    if grad_logprob is None and grad_entropy is None:
        return (None,) * 9
    *saved, row_stats = ctx.saved_tensors  # raises if an input was modified in place since
    hidden, weight, target, bias, temperature = saved
    needs = list(ctx.needs_input_grad[:2]) + [ctx.needs_input_grad[3]]
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(target, dtype=grad_entropy.dtype)
        grads = torch.ops.fce.linear_logprobs_bwd(
            grad_logprob, grad_entropy, row_stats, hidden, weight, target, bias, temperature,
            *ctx.options, needs)
    grads = [g if need else None for g, need in zip(grads, needs)]
    if create_graph:
        grads = _first_order(grads, (grad_logprob, grad_entropy, *saved))
    return grads[0], grads[1], None, grads[2], None, None, None, None, None


torch.library.register_autograd("fce::linear_logprobs_fwd", _backward_logprobs,
                                setup_context=_setup_logprobs)


def _setup_policy(ctx, inputs, output):
    hidden, weight, bias = inputs[0], inputs[1], inputs[4]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    # The gradients the forward formed (for a unit upstream gradient), and the inputs, so
    # that editing one in place before the backward raises.
    ctx.save_for_backward(hidden, weight, bias, *output[1:4])


def _backward_policy(ctx, grad_loss, *_):
    """The forward's gradients scaled by the upstream gradient, rounded once."""
    n_inputs = len(ctx.needs_input_grad)
    if grad_loss is None:
        return (None,) * n_inputs
    *inputs, gh, gw, gb = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 4)]
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        grads = _scaled((gh, gw, gb), grad_loss, ctx.dtypes, needs)
    if create_graph:
        grads = _first_order(grads, (grad_loss, *inputs))
    return grads[0], grads[1], None, None, grads[2], *(None,) * (n_inputs - 5)


torch.library.register_autograd("fce::linear_policy_loss_fwd", _backward_policy,
                                setup_context=_setup_policy)


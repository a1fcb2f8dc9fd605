"""What the ops' autograd formulas share: scaling gradients the forward formed, first
order only, and the fake kernels' gradient outputs.

When the forward computed the gradients (scalar losses), the backward only scales them
by the scalar upstream gradient (fce::scale_grad). Saved tensors are never modified,
so retain_graph and repeated backwards stay correct. The inputs are saved in every
case, so editing one in place before the backward raises torch's version-counter error
instead of returning stale gradients.
"""

import torch

from ..contract.options import schema_args, tensor_args
from ..loop.chunked import VocabShard, grad_dtype, math_dtype_for
from ..loop.tokens import token_weights
from .dispatch import HAS_TRITON, LIB

_NO_DOUBLE = (
    "torch_fce's ops (fce::linear_ce, fce::linear_logprobs, fce::linear_policy_loss, "
    "fce::linear_distillation_loss, fce::linear_soft_cross_entropy, "
    "fce::linear_sparse_divergence) do "
    "not support double backward: their gradients are first order (create_graph=True "
    "gives usable gradients that cannot be differentiated again)"
)

# grad * scale rounded once to dtype (the backward of a loss whose gradients the forward
# computed); scale is the 0-d upstream gradient.
LIB.define("scale_grad(Tensor grad, Tensor scale, ScalarType dtype) -> Tensor")


@torch.library.impl(LIB, "scale_grad", "CompositeExplicitAutograd")
def _scale_grad(grad, scale, dtype):
    if grad.device.type == "cuda" and HAS_TRITON:
        if torch.float64 in (grad.dtype, dtype):  # the kernel multiplies in float32
            return (grad * scale.to(grad)).to(dtype)
        from .scale import _launch_scale_cast  # one pass: no float32 temporary

        out = grad.new_empty(grad.shape, dtype=dtype)
        _launch_scale_cast(grad.contiguous(), scale.to(grad.device), out)
        return out
    return torch.mul(grad, scale, out=grad.new_empty(grad.shape, dtype=dtype))


@torch.library.register_fake("fce::scale_grad")
def _scale_grad_fake(grad, scale, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


def scaled(grads, grad_loss, dtypes, needs):
    """Gradients the forward formed for a unit upstream gradient, scaled by grad_loss and
    rounded to their dtypes in one pass (no float32 temporary of the weight's size)."""
    return [torch.ops.fce.scale_grad(g, grad_loss, dtype) if need else None
            for g, dtype, need in zip(grads, dtypes, needs)]


def dtypes(hidden, weight, bias):
    return hidden.dtype, weight.dtype, None if bias is None else bias.dtype


def first_order(grads, inputs):
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


def input_grads(ctx, at, grads):
    """The backward's return value: grads (hidden, weight, bias) at the argument
    positions `at`, None for every other argument."""
    out = [None] * len(ctx.needs_input_grad)
    for i, g in zip(at, grads):
        out[i] = g
    return tuple(out)


def needs(ctx, at):
    """ctx.needs_input_grad at the positions of hidden, weight and bias."""
    return [ctx.needs_input_grad[i] for i in at]


def fake_grads(hidden, weight, bias, needs_grad, keep_f32, hidden_f32=False):
    """The fake kernels' gradient outputs ((0,) for those not wanted), as
    chunked.grad_outputs forms them."""
    return (
        hidden.new_empty(hidden.shape, dtype=grad_dtype(hidden.dtype, hidden_f32))
        if needs_grad[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape, dtype=grad_dtype(weight.dtype, keep_f32))
        if needs_grad[1] else hidden.new_empty(0),
        bias.new_empty(bias.shape, dtype=grad_dtype(bias.dtype, keep_f32))
        if needs_grad[2] else hidden.new_empty(0),
    )


def fake_forward_grads_outputs(hidden, weight, bias, needs_grad, opts, shard, stats):
    """The fake outputs of a define_forward_grads_ops op: the scalar loss, the gradients
    (as chunked.grad_outputs forms them) and `stats` per-token statistics (N,)."""
    mdt = torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty((), dtype=mdt),
            *fake_grads(hidden, weight, bias, needs_grad, opts.accumulator == "fp32",
                        shard.group is not None),
            *(hidden.new_empty(hidden.shape[0], dtype=mdt) for _ in range(stats)))


def define_forward_grads_ops(name, args, tensors, options, stats, shard=True):
    """Defines the two ops of a scalar loss whose forward forms its gradients (policy
    loss, distillation, soft CE, sparse divergence): the public fce::<name> (args, then the optional
    `tensors` record's with their None defaults, then the `options` record as keywords)
    and the internal fce::<name>_fwd (the same, the records spread, a VocabShard with
    `shard`, then needs_grad) returning (loss, grad_hidden, grad_weight, grad_bias,
    *stats). args: "Tensor hidden, Tensor weight, ..." ("Tensor?" ones default to None
    in the public op); stats: the statistics' names (none: the public op returns the
    loss alone)."""
    public = ", ".join(a + "=None" if a.startswith("Tensor?") else a for a in args)
    internal = [*args, tensor_args(tensors), schema_args(options)] + \
        ([schema_args(VocabShard)] if shard else [])
    out = ", ".join(f"Tensor {s}" for s in ("loss", *stats))
    LIB.define(f"{name}({public}, {tensor_args(tensors, True)}, *, "
               f"{schema_args(options, True)}) -> " + (f"({out})" if stats else "Tensor"))
    LIB.define(f"{name}_fwd({', '.join(internal)}, bool[3] needs_grad) -> (Tensor loss, "
               "Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias"
               + "".join(f", Tensor {s}" for s in stats) + ")")


_SAVED = object()  # an argument's place in the saved tensors


def register_forward_grads_autograd(name, counted=None):
    """The autograd formula of an op whose outputs are (loss, grad_hidden, grad_weight,
    grad_bias, *statistics): a scalar loss sum_t w_t * term_t whose forward formed the
    gradients for a unit upstream gradient (policy loss, distillation, soft CE, sparse
    divergence); its arguments hidden, weight and bias are found by name in its schema.
    The backward scales those gradients by the upstream gradient, rounded once.

    float16 inputs are the exception (the entries ask the forward for no gradient,
    entry.forward_needs_grad): a logits gradient formed for a unit upstream gradient
    would underflow float16 before a GradScaler's scale reached it. Their backward runs
    the op again with the token weights times the upstream gradient (the loss is linear
    in them), so the scale reaches the logits gradient before its rounding, as it
    reaches torch's. counted({argument name: value}) -> the (N,) tokens counted, whose
    token_weights default to 1 / their number (tokens.token_weights, as the op's kernel
    forms them)."""
    names = [a.name for a in getattr(torch.ops.fce, name).default._schema.arguments]
    at = [names.index(n) for n in ("hidden", "weight", "bias")]

    def setup(ctx, inputs, output):
        hidden, weight, bias = (inputs[i] for i in at)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.dtypes = dtypes(hidden, weight, bias)
        ctx.again = hidden.dtype == torch.float16 and counted is not None
        if ctx.again:  # every argument, to run the op again
            ctx.args = [_SAVED if isinstance(a, torch.Tensor) else a for a in inputs]
            ctx.save_for_backward(*(a for a in inputs if isinstance(a, torch.Tensor)))
            return
        # the gradients the forward formed, and the inputs, so that editing one in
        # place before the backward raises
        ctx.save_for_backward(hidden, weight, bias, *output[1:4])

    def backward(ctx, grad_loss, *_):
        if grad_loss is None:
            return input_grads(ctx, at, ())
        wanted = needs(ctx, at)
        if ctx.again:
            saved = iter(ctx.saved_tensors)
            args = [next(saved) if a is _SAVED else a for a in ctx.args]
            inputs = [args[i] for i in at]
            position = names.index("token_weights")
            with torch.no_grad():
                w = token_weights(args[position], counted(dict(zip(names, args))),
                                  math_dtype_for(ctx.dtypes[0]))
                args[position] = w * grad_loss
                args[-1] = wanted  # needs_grad, the last argument
                got = getattr(torch.ops.fce, name)(*args)[1:4]
                out = [g.to(dt) if need else None
                       for g, dt, need in zip(got, ctx.dtypes, wanted)]
        else:
            *inputs, gh, gw, gb = ctx.saved_tensors
            with torch.no_grad():
                out = scaled((gh, gw, gb), grad_loss, ctx.dtypes, wanted)
        if torch.is_grad_enabled():
            out = first_order(out, (grad_loss, *inputs))
        return input_grads(ctx, at, out)

    torch.library.register_autograd(f"fce::{name}", backward, setup_context=setup)

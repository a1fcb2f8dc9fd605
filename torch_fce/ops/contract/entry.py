"""What every public op does before its internal op: convert the user's per-token
arguments (a scalar temperature, per-sequence advantages, int32 targets), refuse what
it cannot differentiate, apply autocast as F.linear would, decide which gradients the
forward forms, and flatten the token dimensions."""

import torch
import torch.autograd.forward_ad as fwAD

_NO_TRANSFORMS = (
    "torch_fce's ops (fce::linear_ce, fce::linear_logprobs, fce::linear_policy_loss, "
    "fce::linear_distillation_loss, fce::linear_soft_cross_entropy, "
    "fce::linear_sparse_divergence, fce::linear_topk_logprobs) have "
    "no forward-mode derivative and no torch.func derivative "
    "(grad, jvp, jacrev, hessian, dual tensors; vmap of the forward alone runs): use "
    "torch.autograd (loss.backward() or torch.autograd.grad) for its gradients"
)


def autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta): nothing to cast
        return False


def refuse_transforms(tensors):
    """Forward AD and functorch's derivatives would otherwise see a tangent of 0 or an
    internal error; vmap alone is served by torch's per-sample fallback. Dynamo
    refuses functorch transforms of its own (and cannot trace these checks)."""
    if torch.compiler.is_dynamo_compiling():
        return
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


def autocast_operands(hidden, weight, bias):
    """As F.linear under torch.autocast: products in the autocast dtype.

    A float32 weight stays float32 (master weights): the kernels run the products in
    hidden's dtype and sum its gradient in float32; a float32 bias stays float32
    (chunked.LogitsGemm adds it as TRL's heads do).
    """
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, bias) if t is not None):
        return hidden, weight, bias  # check_head_inputs names the argument
    device = hidden.device.type
    if not autocast_enabled(device) or hidden.dtype == torch.float64:
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device)
    if weight.dtype != torch.float32:
        weight = weight.to(dtype)
    if bias is not None and bias.dtype not in (dtype, weight.dtype, torch.float32):
        bias = bias.to(dtype)
    return hidden.to(dtype), weight, bias


def needs_grad(hidden, weight, bias, enabled=True):
    """[hidden, weight, bias] flags: which gradients the forward should form."""
    grad = enabled and torch.is_grad_enabled()
    return [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]


def forward_needs_grad(hidden, weight, bias):
    """needs_grad of a scalar loss whose forward forms its gradients: none for float16,
    whose backward forms them with the upstream gradient (grads.py says why)."""
    return needs_grad(hidden, weight, bias, hidden.dtype != torch.float16)


def token_rows(hidden):
    """hidden (*, D) as (N, D): one row per token."""
    return hidden.reshape(-1, hidden.shape[-1])


def flat(t):
    """A per-token tensor (*) as (N,); None stays None."""
    return None if t is None else t.reshape(-1)


def temperature_tensor(temperature, target):
    """None for 1.0; a float > 0 as is checked here; a tensor broadcast to target."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if isinstance(temperature, torch.Tensor):
        try:
            return temperature.expand(target.shape)
        except RuntimeError:
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} does not "
                             f"broadcast to the tokens' shape (hidden's leading shape) "
                             f"{tuple(target.shape)}") from None
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

"""Argument checks shared by the op's entry point and its fake kernels.

Everything here works on fake/symbolic tensors too, so bad input fails at trace
time with the same message as in eager mode. Shape checks go through
`torch._check_with`, which accepts SymBools without specialising.
"""

import os

import torch

from .options import as_float, check_choice, check_int, got
from .options import value as _value

# Opt-in eager check of target ranges on CUDA (it syncs with the host): without it,
# out-of-range targets give NaN losses and are never read out of bounds (docs/api.md).
CHECK_TARGETS = os.environ.get("TORCH_FCE_CHECK_TARGETS") == "1"

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
TARGET_DTYPES = (torch.int64, torch.int32)
ACCUMULATORS = ("fp32", "kahan", "input")


def check_common(opts):
    """The options every op's record has: ignore_index, logits_dtype, and accumulator
    (the ops with gradients) and softcap where it has them."""
    if hasattr(opts, "accumulator"):
        check_choice("accumulator", opts.accumulator, ACCUMULATORS)
    if opts.logits_dtype not in (None, torch.float32):
        raise ValueError(f"logits_dtype must be None (hidden's dtype) or torch.float32, "
                         f"got {opts.logits_dtype!r}")
    check_int("ignore_index", opts.ignore_index)
    cap = getattr(opts, "softcap", None)
    if cap is not None and not 0.0 < as_float("softcap", cap) < float("inf"):
        raise ValueError(f"softcap must be None or a finite float > 0{got(cap)}")


def check_truncation(opts):
    """The sampler's truncation options (top_k, top_p, min_p; linear_logprobs/truncation.py):
    None each, or an int >= 1, a float in (0, 1], a float in [0, 1]."""
    if opts.top_k is not None:
        check_int("top_k", opts.top_k)
        if opts.top_k < 1:
            raise ValueError(f"top_k must be None (no top-k) or an int >= 1{got(opts.top_k)}")
    if opts.top_p is not None and not 0.0 < as_float("top_p", opts.top_p) <= 1.0:
        raise ValueError(f"top_p must be None or a float in (0, 1]{got(opts.top_p)}")
    if opts.min_p is not None and not 0.0 <= as_float("min_p", opts.min_p) <= 1.0:
        raise ValueError(f"min_p must be None or a float in [0, 1]{got(opts.min_p)}")


def check_temperature(temperature, target, like="target"):
    """A float tensor of target's shape on its device, not requiring grad (like: as
    check_per_token's). The kernels check its values (check_temperature_values)."""
    check_per_token("temperature", temperature, target, like)


def check_per_token(name, t, target, like="target"):
    """None, or a float tensor of target's shape on its device that does not require
    grad (a per-token input that is not differentiated); `like` names target in the
    messages (None: target is the tokens' shape of an op without one, named as
    hidden's leading shape)."""
    shape = "hidden's leading shape" if like is None else \
        f"{like}'" + ("" if like.endswith("s") else "s") + " shape"
    if t is None:
        return
    _check_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if t.dim() != target.dim():
        raise ValueError(f"{name} must have {shape} {tuple(target.shape)}, "
                         f"got {tuple(t.shape)}")
    for a, b in zip(t.shape, target.shape):
        _value(a == b, f"{name} must have {shape} {tuple(target.shape)}, "
                       f"got {tuple(t.shape)}")
    if t.device != target.device:
        raise ValueError(f"{name} is on {t.device} but {like or 'hidden'} is on "
                         f"{target.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} must not require grad: it is not differentiated; "
                         f"pass {name}.detach()")


def check_temperature_values(temperature):
    """Raises unless every temperature is > 0 (syncs: always on the CPU, opt-in on CUDA
    with the target check; otherwise such a token's outputs are NaN)."""
    if temperature is not None and not bool((temperature > 0).all()):
        raise ValueError("temperature must be > 0 (and not NaN) everywhere")


def check_leading_shape(name, t, hidden, k):
    """t (*, k) with * hidden's leading shape (a support of k classes a token)."""
    msg = (f"{name} must have shape (*, {k}) with * hidden's leading shape "
           f"{tuple(hidden.shape[:-1])}, got {tuple(t.shape)}")
    if t.dim() < 1 or t.dim() != hidden.dim():
        raise ValueError(msg)
    for a, b in zip(t.shape[:-1], hidden.shape[:-1]):
        _value(a == b, msg)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")


def check_head_inputs(hidden, weight, target, bias, class_weight, vocab=None):
    """Checks shapes, dtypes and devices; hidden (*, D), weight (V, D), target (*).
    vocab: the whole vocabulary's size, class_weight's length, when weight holds a
    shard of it (vocab-parallel; bias is the shard's)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        _check_tensor(name, t)
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"hidden must be bfloat16, float16 or float32 (float64 for gradcheck), "
            f"got {hidden.dtype}")
    if weight.dtype not in (hidden.dtype, torch.float32):
        raise TypeError(
            f"weight must have hidden's dtype ({hidden.dtype}) or float32, got {weight.dtype}"
        )
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (*, D), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, D), got {tuple(weight.shape)}")
    if target.dim() != hidden.dim() - 1:
        raise ValueError(
            f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    _value(
        weight.shape[1] == hidden.shape[-1],
        f"weight must have shape (V, D) with D = hidden.shape[-1] = {hidden.shape[-1]}, "
        f"got {tuple(weight.shape)}",
    )
    for i in range(target.dim()):
        _value(
            target.shape[i] == hidden.shape[i],
            f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got {tuple(target.shape)}",
        )
    for name, t, dtypes, V, what in (
        ("bias", bias, bias_dtypes(hidden, weight), weight.shape[0], "V"),
        ("class_weight", class_weight, FLOAT_DTYPES,
         weight.shape[0] if vocab is None else vocab, "V" if vocab is None else "vocab_size"),
    ):
        if t is None:
            continue
        _check_tensor(name, t)
        if t.dtype not in dtypes:
            want = "be a floating-point tensor" if dtypes is FLOAT_DTYPES \
                else f"have dtype in {dtypes}"
            raise TypeError(f"{name} must {want}, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must have shape ({what},) = ({V},), got {tuple(t.shape)}")
        _value(t.shape[0] == V, f"{name} must have shape ({what},) = ({V},), got "
                                f"{tuple(t.shape)}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias),
                    ("class_weight", class_weight)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")


def bias_dtypes(hidden, weight):
    """A head bias's dtypes: hidden's, weight's, or float32 (a master bias beside
    low-precision weights, as TRL's heads take; chunked.LogitsGemm says how it adds)."""
    return tuple(dict.fromkeys((hidden.dtype, weight.dtype, torch.float32)))


def check_log_probs(values, bad, name):
    """Raises ValueError where bad marks values (log-probabilities called `name`) that
    cannot be ones: NaN, +inf or above 0 (syncs)."""
    if bad.any():
        raise ValueError(f"{name} must be log-probabilities (<= 0, not NaN) where the "
                         f"support is not ignore_index; got {float(values[bad][0])}")


def check_target_range(target, V, ignore_index, name="target"):
    """Raises IndexError for a target (class indices called `name`) outside [0, V) that
    is not ignore_index (syncs)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bad.any():
        raise IndexError(
            f"{name} holds {int(target[bad][0])}, outside [0, V) = [0, {V}) and not "
            f"ignore_index ({ignore_index})"
        )

"""The token-chunked loop shared by every backend.

Per chunk of n tokens: logits = hidden @ weight.T + bias (one GEMM into an (n, V)
buffer), a row function turns them into per-token terms and, when gradients are
wanted, the logits gradient dz, then dz @ weight gives the hidden gradient and dz.T @
hidden is added to the weight gradient. Memory beyond inputs and outputs is the (n, V)
chunk plus the gradient accumulator (and, for float32 master weights, the weight in
hidden's dtype for the GEMMs); n is chosen per backend from a fixed budget.
Backends differ only in the row function and the chunk size.
"""

import torch
import torch.nn.functional as F

from .accumulate import GradAccumulator
from .rows import RowOptions
from .tokens import grad_scales, reduce_loss


def math_dtype_for(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_chunks(hidden, weight, target, bias, class_weight, opts, needs_grad, ce_scale,
               z_scale, rows, chunk_rows, accumulator):
    """Returns (lse, nll, smooth) each (N,), and (grad_hidden, grad_weight, grad_bias).

    ce_scale/z_scale are None when no gradient is wanted. Gradients not flagged in
    needs_grad are None. grad_weight/grad_bias come back in the accumulator's dtype.
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = hidden.dtype
    mdt = math_dtype_for(dtype)
    w = weight.to(dtype)  # products run in hidden's dtype (master weights: as autocast)
    b = None if bias is None else bias.to(dtype)
    lse, nll, smooth = (hidden.new_empty(N, dtype=mdt) for _ in range(3))
    gh = hidden.new_empty(hidden.shape) if needs_grad[0] else None
    gw = GradAccumulator(accumulator, (V, D), dtype, weight.dtype, hidden.device) \
        if needs_grad[1] else None
    gb = hidden.new_zeros(V, dtype=mdt) if needs_grad[2] else None
    for s in range(0, N, chunk_rows):
        e = min(N, s + chunk_rows)
        h = hidden[s:e]
        logits = F.linear(h, w, b)
        scales = (None, None) if ce_scale is None else (ce_scale[s:e], z_scale[s:e])
        lse[s:e], nll[s:e], smooth[s:e], dz = rows(
            logits, target[s:e], class_weight, *scales, opts, mdt)
        if gh is not None:
            torch.mm(dz, w, out=gh[s:e])
        if gw is not None:
            gw.add(dz, h)
        if gb is not None:
            gb += dz.sum(0, dtype=mdt)
        del logits, dz  # freed before the next chunk is allocated: one chunk at a time
    return (lse, nll, smooth), (gh, gw, gb)


def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                  label_smoothing, softcap, z_loss, accumulator, needs_grad, *, rows,
                  chunk_rows):
    """fce::linear_ce_fwd on one device, given its row function and chunk size."""
    opts = RowOptions(ignore_index, label_smoothing, softcap)
    want = any(needs_grad)
    ce_scale, z_scale = grad_scales(target, class_weight, ignore_index, reduction, z_loss,
                                    math_dtype_for(hidden.dtype)) if want else (None, None)
    with torch.autocast(hidden.device.type, enabled=False):
        (lse, nll, smooth), grads = run_chunks(
            hidden, weight, target, bias, class_weight, opts, needs_grad, ce_scale, z_scale,
            rows, chunk_rows, accumulator)
        loss = reduce_loss(nll, smooth, lse, target, class_weight, ignore_index, reduction,
                           label_smoothing, z_loss, weight.shape[0])
    return (loss, *_grad_outputs(hidden, weight, bias, grads, accumulator == "fp32"))


def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, ignore_index,
                  reduction, label_smoothing, softcap, z_loss, accumulator, needs_grad, *,
                  rows, chunk_rows):
    """fce::linear_ce_bwd on one device: recomputes the logits chunk by chunk."""
    mdt = math_dtype_for(hidden.dtype)
    opts = RowOptions(ignore_index, label_smoothing, softcap)
    ce_scale, z_scale = grad_scales(
        target, class_weight, ignore_index, reduction, z_loss, mdt, grad_loss=grad_loss)
    with torch.autocast(hidden.device.type, enabled=False):
        _, grads = run_chunks(hidden, weight, target, bias, class_weight, opts, needs_grad,
                              ce_scale, z_scale, rows, chunk_rows, accumulator)
    return _grad_outputs(hidden, weight, bias, grads, keep_f32=False)


def grad_dtype(dtype, keep_f32):
    """Output dtype of a weight/bias gradient: float32 sums are kept for the backward."""
    return torch.promote_types(dtype, torch.float32) if keep_f32 else dtype


def _grad_outputs(hidden, weight, bias, grads, keep_f32):
    """Casts gradients to their output dtypes; (0,) placeholders for those not wanted."""
    gh, gw, gb = grads
    return (
        hidden.new_empty(0) if gh is None else gh,
        hidden.new_empty(0) if gw is None else gw.result(grad_dtype(weight.dtype, keep_f32)),
        hidden.new_empty(0) if gb is None else gb.to(grad_dtype(bias.dtype, keep_f32)),
    )

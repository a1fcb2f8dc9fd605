"""Per-row loss math in plain PyTorch: the CPU backend's counterpart of the Triton row kernel.

For a chunk of logits rows z (n, V) (after bias), with p = softmax(softcap(z)):
  lse    = logsumexp(softcap(z))
  nll    = w_y * (lse - z_y)                 (0 where ignored)
  smooth = sum_c w_c * (lse - z_c)           (0 where ignored; only with label smoothing)
  dz_c   = [p_c * A - B * [c == y] - C * w_c] * softcap'(z_c)
with A = s * ((1 - eps) * w_y + eps * W / V) + 2 * t * lse, B = s * (1 - eps) * w_y,
C = s * eps / V, W = sum_c w_c, s the per-token CE gradient scale and t the per-token
z-loss scale (see tokens.grad_scales).
"""

from typing import NamedTuple, Optional

import torch


class RowOptions(NamedTuple):
    ignore_index: int
    label_smoothing: float
    softcap: Optional[float]


def softcapped(logits, softcap, math_dtype):
    """(z, tanh): the logits in math_dtype after the softcap, and tanh(logits / softcap)
    for its derivative (None without softcap). Overwrites logits where it can."""
    z = logits.to(math_dtype)  # the buffer itself when it already is math_dtype
    if softcap is None:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh


def logits_grad_(e, norm, tgt, onehot_scale, w_y, lse, cw, W, V, ce_scale, z_scale, opts,
                 tanh):
    """Turns e (n, Vs) = exp(z - c) with softmax = e * norm into dz, in place.

    Vs may be a shard of the V classes (vocab parallel): tgt is then the target's column
    in the shard and onehot_scale is 0 for rows whose target lives elsewhere; cw is the
    shard's class weights; w_y, W, lse, scales are those of the whole vocabulary.
    """
    eps = opts.label_smoothing
    a = ce_scale * ((1.0 - eps) * w_y + (eps / V) * W) + 2.0 * z_scale * lse
    dz = e.mul_((a * norm)[:, None])  # softmax * A
    dz.scatter_add_(1, tgt[:, None], (-ce_scale * (1.0 - eps) * w_y * onehot_scale)[:, None])
    if eps > 0.0:
        c = (ce_scale * (eps / V))[:, None]
        dz -= c if cw is None else c * cw[None, :]
    if tanh is not None:
        dz.mul_(1.0 - tanh * tanh)
    return dz


def torch_rows(logits, target, class_weight, ce_scale, z_scale, opts, math_dtype):
    """Returns (lse, nll, smooth, dz) for logits (n, V); dz is None without ce_scale.

    logits is the backend's own chunk buffer: it is overwritten (the math runs in place
    to keep the passes over the chunk few). ce_scale/z_scale: (n,) math_dtype. dz has
    logits' dtype.
    """
    n, V = logits.shape
    eps = opts.label_smoothing
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    valid = target != opts.ignore_index
    tgt = torch.where(valid, target, 0).long()
    cw = None if class_weight is None else class_weight.to(math_dtype)
    w_y = valid.to(math_dtype) if cw is None else torch.where(valid, cw[tgt], 0.0)
    z_y = z.gather(1, tgt[:, None]).squeeze(1)
    W = float(V) if cw is None else cw.sum()
    zsum = (z.sum(-1) if cw is None else z @ cw) if eps > 0.0 else None
    m = z.amax(-1, keepdim=True).clamp_min(torch.finfo(math_dtype).min)  # finite if all -inf
    e = z.sub_(m).exp_()  # z is consumed from here on
    total = e.sum(-1)
    lse = m.squeeze(1) + total.log()
    nll = w_y * (lse - z_y)
    smooth = torch.where(valid, W * lse - zsum, 0.0) if eps > 0.0 else torch.zeros_like(lse)
    if ce_scale is None:
        return lse, nll, smooth, None
    dz = logits_grad_(e, 1.0 / total, tgt, 1.0, w_y, lse, cw, W, V, ce_scale, z_scale, opts,
                      tanh)
    return lse, nll, smooth, dz.to(logits.dtype)

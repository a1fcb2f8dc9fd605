"""Per-row cross-entropy math in plain PyTorch (the rows of every device but CUDA with
Triton): the counterpart of the Triton row kernel (kernels.py).

For a chunk of logits rows z (n, V) (after bias), with p = softmax(softcap(z)):
  lse    = logsumexp(softcap(z))
  nll    = w_y * (lse - z_y)                 (0 where ignored, whatever the logits)
  smooth = sum_c w_c * (lse - z_c)           (0 where ignored; only with label smoothing)
  entropy = -sum_c p_c log p_c = log s - sum_c e_c (z_c - m) / s, e_c = exp(z_c - m),
           m the row max, s = sum_c e_c     (with the token statistics only)
  dz_c   = [p_c * A - B * [c == y] - C * w_c] * softcap'(z_c)   (grad_coefficients
           gives A, B, C; logits_grad_ forms dz from them)
With dft (Dynamic Fine-Tuning, arXiv 2508.05629;
no smoothing, no z-loss), nll and s are times p_y, the target's probability, taken as a
constant: the loss is sum of p_y * nll with p_y detached.
"""

from typing import Callable, NamedTuple, Optional

import torch

from ..loop.tokens import counted_target_weights
from ..rowmath.common import first_max, row_sum, softcapped


class CETerms(NamedTuple):
    """A chunk's per-token cross-entropy terms, each (n,): lse, nll, smooth (zeros
    without label smoothing) and the token statistics, None unless asked for: argmax
    (int64, the first most likely class) and entropy (of every token, ignored ones
    too)."""
    lse: torch.Tensor
    nll: torch.Tensor
    smooth: torch.Tensor
    argmax: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]


class CERows(NamedTuple):
    """The cross entropy's row functions on one backend. opts is the op's options
    record (ops/linear_ce.CEOptions: ignore_index, label_smoothing, softcap are read);
    logits (n, V) is the loop's buffer and may be overwritten.
      stats(logits, target, class_weight, opts, token_stats, math_dtype) -> CETerms
          (argmax and entropy with token_stats)
      stats_then_grad(logits, target, class_weight, scales, opts, token_stats,
                      math_dtype, dz_dtype) -> (CETerms, dz): scales = (ce_scale, z_scale) (n,)
          (tokens.grad_scales); dz in dz_dtype (the inputs', which float32 logits of
          low-precision inputs are wider than), written over logits where it can
      shard_stats(logits, col, cw, opts, math_dtype) -> (lse, z_y, zsum) of a
          vocabulary shard (vocab-parallel: all-reduced before shard_grad)
      shard_grad(logits, col, cw, lse, a, b, c, opts, math_dtype, dz_dtype) -> dz of a
          shard, from the global lse and grad_coefficients"""
    stats: Callable
    stats_then_grad: Callable
    shard_stats: Callable
    shard_grad: Callable


def grad_coefficients(ce_scale, z_scale, w_y, lse, W, V, eps):
    """(A, B, C), each (n,), of dz_c = [p_c A - B [c == y] - C w_c] softcap'(z_c); C is
    None without smoothing. s = ce_scale, the per-token CE gradient scale, and t =
    z_scale, the z-loss's (tokens.grad_scales); W = sum_c w_c, eps the smoothing.
    w_y, W, lse and V are those of the whole vocabulary, also for a vocabulary shard.
    """
    # A = s ((1 - eps) w_y + eps W / V) + 2 t lse: the softmax's coefficient (the
    # smoothing's and the z-loss's terms are sum-over-classes weights of p)
    a = ce_scale * ((1.0 - eps) * w_y + (eps / V) * W) + 2.0 * z_scale * lse
    # Exactly 0 where both scales are (ignored tokens), also when lse is not finite.
    a = torch.where((ce_scale == 0.0) & (z_scale == 0.0), 0.0, a)
    # B = s (1 - eps) w_y at the target; C = s eps / V at every class (times w_c)
    return a, ce_scale * (1.0 - eps) * w_y, ce_scale * (eps / V) if eps > 0.0 else None


def dft_weight(valid, logprob):
    """DFT's per-token weight: p(target) = exp(logprob), 0 where ignored."""
    return torch.where(valid, logprob.exp(), 0.0)


def logits_grad_(e, norm, col, a, b, c, cw, tanh):
    """Turns e (n, Vs) = exp(z - k) with softmax = e * norm into dz, in place.

    Vs may be a shard of the vocabulary (vocab parallel): col is then each target's
    column in the shard, -1 where it lives elsewhere (or is ignored), and cw the shard's
    class weights.
    """
    dz = e.mul_((a * norm)[:, None])  # softmax * A
    here = col >= 0
    dz.scatter_add_(1, col.clamp_min(0).long()[:, None], torch.where(here, -b, 0.0)[:, None])
    if c is not None:
        dz -= c[:, None] if cw is None else c[:, None] * cw[None, :]
    if tanh is not None:
        dz.mul_(1.0 - tanh * tanh)
    # Rows with no coefficient (ignored tokens) get exactly 0, also when their logits
    # are not finite (a NaN hidden state): as torch, which never reads such rows.
    zero = (a == 0.0) & (b == 0.0) & (True if c is None else c == 0.0)
    return dz.masked_fill_(zero[:, None], 0.0)


def torch_shard_stats(logits, col, cw, opts, math_dtype):
    """(lse, z_y, zsum) (n,) of a vocabulary shard's logits (n, Vs): the shard's
    logsumexp, the target logit where col >= 0 (else 0), and sum_c w_c z_c (with label
    smoothing, else None). Leaves logits as they are (the gradient sweep follows)."""
    z = logits.to(math_dtype)
    if opts.softcap is not None:
        z = torch.tanh(z / opts.softcap) * opts.softcap
    z_y = torch.where(col >= 0, z.gather(1, col.clamp_min(0).long()[:, None]).squeeze(1), 0.0)
    zsum = (row_sum(z) if cw is None else z @ cw.to(math_dtype)) \
        if opts.label_smoothing > 0.0 else None
    return torch.logsumexp(z, -1), z_y, zsum


def torch_shard_grad(logits, col, cw, lse, a, b, c, opts, math_dtype, dz_dtype):
    """dz (n, Vs) in dz_dtype for a vocabulary shard, given the global lse and the
    coefficients of grad_coefficients. Overwrites logits."""
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    e = z.sub_(lse[:, None]).exp_()
    cw = None if cw is None else cw.to(math_dtype)
    return logits_grad_(e, 1.0, col, a, b, c, cw, tanh).to(dz_dtype)


def torch_ce_stats(logits, target, class_weight, opts, token_stats, math_dtype):
    """CERows.stats in PyTorch."""
    return _torch_rows(logits, target, class_weight, None, opts, token_stats, math_dtype,
                       None)[0]


def torch_ce_stats_then_grad(logits, target, class_weight, scales, opts, token_stats,
                             math_dtype, dz_dtype):
    """CERows.stats_then_grad in PyTorch."""
    return _torch_rows(logits, target, class_weight, scales, opts, token_stats, math_dtype,
                       dz_dtype)


def _torch_rows(logits, target, class_weight, scales, opts, token_stats, math_dtype,
                dz_dtype):
    """(CETerms, dz) for logits (n, V); dz is None without scales. The math runs in
    place over logits to keep the passes over the chunk few."""
    n, V = logits.shape
    eps = opts.label_smoothing
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    valid, w_y = counted_target_weights(target, class_weight, opts.ignore_index, V,
                                        math_dtype)
    tgt = torch.where(valid & (target >= 0) & (target < V), target, 0).long()
    cw = None if class_weight is None else class_weight.to(math_dtype)
    z_y = z.gather(1, tgt[:, None]).squeeze(1)
    W = float(V) if cw is None else cw.sum()
    zsum = (row_sum(z) if cw is None else z @ cw) if eps > 0.0 else None
    argmax = first_max(z)[1] if token_stats else None
    m = z.amax(-1, keepdim=True).clamp_min(torch.finfo(math_dtype).min)  # finite if all -inf
    e = z.sub_(m).exp_()  # z is consumed from here on
    total = row_sum(e)
    log_s = total.log()
    lse = m.squeeze(1) + log_s
    # xlogy(e, e) = e (z - m), 0 at e = 0 (-inf logits): relative to the max, so a
    # confident row's entropy does not cancel against lse
    entropy = log_s - row_sum(torch.special.xlogy(e, e)) / total if token_stats else None
    # relative to the max, as dz: a confident row keeps float32 precision (not lse's)
    logp_y = (z_y - m.squeeze(1)) - log_s
    nll = torch.where(valid, -w_y * logp_y, 0.0)  # ignored rows may be NaN
    p_y = dft_weight(valid, logp_y) if opts.dft else None
    nll = nll if p_y is None else nll * p_y
    smooth = torch.where(valid, W * lse - zsum, 0.0) if eps > 0.0 else torch.zeros_like(lse)
    terms = CETerms(lse, nll, smooth, argmax, entropy)
    if scales is None:
        return terms, None
    ce_scale, z_scale = scales
    a, b, c = grad_coefficients(ce_scale if p_y is None else ce_scale * p_y, z_scale, w_y,
                                lse, W, V, eps)
    dz = logits_grad_(e, 1.0 / total, torch.where(valid, tgt, -1), a, b, c, cw, tanh)
    return terms, dz.to(dz_dtype)


TORCH_CE_ROWS = CERows(torch_ce_stats, torch_ce_stats_then_grad, torch_shard_stats,
                       torch_shard_grad)

"""Per-row log-prob math in plain PyTorch: the CPU backend's counterpart of the Triton
log-prob row kernel (triton/logprob_rows.py).

For a chunk of logits rows l (n, V) (after bias), with z = softcap(l) / T (T the row's
temperature) and p = softmax(z):
  lse     = logsumexp(z)
  logprob = z_y - lse                                  (0 where ignored)
  entropy = -sum_c p_c log p_c = lse - mu, mu = sum_c p_c z_c   (0 where ignored)
  argmax  = argmax_c z_c (the first one), as an index
and for upstream gradients g (of logprob) and h (of entropy), zero where ignored:
  dl_c = (g * ([c == y] - p_c) - h * p_c * (z_c - mu)) * softcap'(l_c) / T
The backward takes the forward's row statistics relative to the row max m, (m, log s,
d) with s = sum_c exp(z_c - m) and d = mu - m, so it reads each recomputed logit once
and forms p_c = exp((z_c - m) - log s) and z_c - mu = (z_c - m) - d: z_c - m is exact
near the max, where z_c - lse at large magnitudes would lose 1 - p of confident rows.
"""

import torch

from .rows import softcapped


def torch_logprob_rows(logits, target, inv_t, opts, entropy, grad, math_dtype, col0=0):
    """Returns (logprob, entropy, lse, argmax, row_stats, dz) for logits (n, V).

    logits is the backend's chunk buffer and is overwritten. inv_t (n,) is 1/T (NaN for
    a temperature that is not > 0). Without grad (the forward): the per-token terms and
    row_stats (n, 3) = (m, log s, d), dz None; entropy says whether to form it (else its
    slot and d are not meant to be read). With grad = (g_lp, g_h, row_stats) (the
    backward): the upstream gradients, (n,) each (g_h None without an entropy gradient),
    and the forward's row_stats; only dz, in logits' dtype, the other slots None. With
    grad a function (logprob, entropy) -> (g_lp, g_h) (a loss formed in the forward):
    the forward's outputs and dz for the upstream gradients it returns.
    In the backward, the logits may be the classes [col0, col0 + V) of a vocabulary
    tile (targets are whole-vocabulary indices).
    """
    n, V = logits.shape
    z, tanh = softcapped(logits, opts.softcap, math_dtype)
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < V)
    tgt = torch.where(valid & in_range, target, 0).long()
    if grad is None or callable(grad):
        argmax = z.argmax(-1)
        z.mul_(inv_t[:, None])
        z_y = z.gather(1, tgt[:, None]).squeeze(1)
        m = z.amax(-1, keepdim=True).clamp_min(torch.finfo(math_dtype).min)
        e = (z - m).exp()
        total = e.sum(-1)
        log_s = total.log()
        lse = m.squeeze(1) + log_s
        # A counted target outside [0, V) poisons its row with NaN (as the loss does).
        logprob = torch.where(valid, torch.where(in_range, z_y - lse, float("nan")), 0.0)
        ent, d = torch.zeros_like(lse), torch.zeros_like(lse)
        if entropy:
            # d = sum_c p_c (z_c - m): entropy = log(total) - d, with no 0 * -inf at
            # -inf logits and no cancellation against m for confident rows.
            d = torch.where(e > 0, e * (z - m), 0.0).sum(-1) / total
            ent = torch.where(valid, log_s - d, 0.0)
        row_stats = torch.stack([m.squeeze(1), log_s, d], 1)
        if grad is None:
            return logprob, ent, lse, argmax, row_stats, None
        del e
        # The forward with its gradient (a loss of the per-token terms): the upstream
        # gradients from the terms, then dz from the same z, with no second GEMM.
        g_lp, g_h = grad(logprob, ent)
        outputs = (logprob, ent, lse, argmax, row_stats)
        z.sub_(m)  # z - m
    else:
        g_lp, g_h, row_stats = grad
        outputs = (None,) * 5
        z.mul_(inv_t[:, None]).sub_(row_stats[:, :1])  # z - m
    m, log_s, d = row_stats.unbind(1)
    g = torch.where(valid, g_lp, 0.0)
    p = z.sub(log_s[:, None]).exp_()
    if g_h is None:
        dz = p.mul_(-g[:, None])
    else:
        h = torch.where(valid, g_h, 0.0)
        ent_term = torch.where(p > 0, p * h[:, None] * (z - d[:, None]), 0.0)
        dz = p.mul_(-g[:, None]).sub_(ent_term)
    # A counted target outside the tile adds nothing here (outside [0, V) its outputs
    # are NaN).
    here = (target >= col0) & (target < col0 + V)
    dz.scatter_add_(1, torch.where(here, target - col0, 0).long()[:, None],
                    torch.where(here, g, 0.0)[:, None])
    dz.mul_(inv_t[:, None])
    if tanh is not None:
        dz.mul_(1.0 - tanh * tanh)
    # Ignored rows get exactly 0, whatever their logits (a NaN hidden state).
    dz.masked_fill_((~valid)[:, None], 0.0)
    return (*outputs, dz.to(logits.dtype))

"""The distillation's row math: one chunk's divergence, student entropy, hard loss and
the student's logits gradient, from the student's and the teacher's logits (PyTorch, on
every device).

With a_s = softcap(logit_scale * z_s), u_s = a_s / T (the teacher's alike), q =
softmax(u_s), p = softmax(u_t) and TRL's generalized JSD convention:
  beta = 0: KL(p || q) = sum p (log p - log q),        d/du_s = q - p
  beta = 1: KL(q || p) = sum q (log q - log p),        d/du_s = q (log q - log p - KL)
  between:  beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q,
            d/du_s = q (g - sum q g), g = (1 - beta) (log q - log m)
(the beta-weighted terms' derivatives through m cancel: sum_j (beta p_j + (1 - beta)
q_j) / m_j dm_j = 0), plus hard_weight times the cross entropy of softmax(a_s) at the
target, d/da_s = softmax(a_s) - onehot(target). Every term is formed relative to the
rows' own log-sum-exp (log_softmax), in float32 (float64 for float64 inputs).
"""

import math
from typing import Callable, NamedTuple

import torch


class DistillRows(NamedTuple):
    """The distillation's row function on one backend: rows(z_s, z_t, target, valid,
    inv_t, weights, opts, math_dtype, dz_dtype, want_grad) -> (loss_t, divergence,
    entropy, dz) (divergence_rows' contract), and how many float32 (n, V) temporaries
    it allocates beyond both heads' logits and dz (for the workspace's bytes per
    logit)."""
    rows: Callable
    temporaries: int


def _capped(z, scale, cap, mdt):
    """(softcap(scale * z) in mdt, d a / d z or None when it is the scale itself)."""
    a = z.to(mdt) * scale
    if cap is None:
        return a, None
    a = torch.tanh(a / cap).mul_(cap)
    return a, (1.0 - (a / cap) ** 2) * scale


def divergence_rows(z_s, z_t, target, valid, inv_t, weights, opts, mdt, dz_dtype,
                    want_grad):
    """(loss_t, divergence, entropy, dz) of a chunk: z_s, z_t (n, V) the student's and
    teacher's logits; target (n,) or None; valid (n,) the tokens counted; inv_t, weights
    (n,) 1 / T and w_t. loss_t = w_t (divergence + hard_weight * CE), 0 where not
    counted; divergence and entropy 0 there too; dz (n, V) in dz_dtype, d sum(loss_t) /
    d z_s, or None."""
    a_s, da_s = _capped(z_s, opts.logit_scale, opts.softcap, mdt)
    a_t, _ = _capped(z_t, opts.teacher_logit_scale, opts.teacher_softcap, mdt)
    del z_t
    inv = inv_t[:, None]
    log_q = torch.log_softmax(a_s * inv, -1)
    log_p = torch.log_softmax(a_t.mul_(inv), -1)
    del a_t
    q = log_q.exp()
    entropy = -(q * log_q).sum(-1)
    beta = opts.beta
    if beta == 0.0:
        p = log_p.exp()
        div = (p * (log_p - log_q)).sum(-1)
        grad = (q - p) if want_grad else None
    elif beta == 1.0:
        diff = log_q - log_p
        div = (q * diff).sum(-1)
        grad = q * (diff - div[:, None]) if want_grad else None
    else:
        log_m = torch.logaddexp(log_q + math.log(1.0 - beta), log_p + math.log(beta))
        p = log_p.exp()
        div = beta * (p * (log_p - log_m)).sum(-1) + \
            (1.0 - beta) * (q * (log_q - log_m)).sum(-1)
        if want_grad:
            g = (log_q - log_m).mul_(1.0 - beta)
            grad = q * (g - (q * g).sum(-1, keepdim=True))
        else:
            grad = None
    zero = torch.zeros_like(div)
    loss_t = div
    ce = None
    if opts.hard_weight != 0.0:
        lq1 = torch.log_softmax(a_s, -1)
        safe = torch.where(valid, target, 0).long().unsqueeze(1)
        ce = -lq1.gather(1, safe).squeeze(1)
        loss_t = div + opts.hard_weight * ce
    loss_t = torch.where(valid, weights * loss_t, zero)
    if not want_grad:
        dz = None
    else:
        w = torch.where(valid, weights, zero)[:, None]
        grad = grad.mul_(inv)  # d / d a_s of the divergence
        if ce is not None:
            hard = lq1.exp_()
            hard.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=hard.dtype))
            grad = grad.add_(hard, alpha=opts.hard_weight)
        grad = grad.mul_(w)
        grad = grad.mul_(da_s) if da_s is not None else grad.mul_(opts.logit_scale)
        # ignored tokens: 0, also where their logits are not finite
        dz = torch.where(valid[:, None], grad, 0.0).to(dz_dtype)
    return (loss_t, torch.where(valid, div, zero), torch.where(valid, entropy, zero), dz)


TORCH_DISTILL_ROWS = DistillRows(divergence_rows, temporaries=6)

"""The distillation's row math (PyTorch, on every device): one chunk's divergence,
student entropy, hard loss and the student's logits gradient from the student's and the
teacher's logits (divergence_rows), and the losses over a few classes of each row
(sparse_rows, below: the sparse-target cross entropy's, soft_ce_rows, and the sparse
divergence's over a teacher's top-k, sparse_divergence_rows).

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

import torch

from ..loop.chunked import ONE_DEVICE
from ..rowmath.common import RowMath, capped, row_sum


def _log_softmax(a, shard):
    """log softmax of the rows of a (n, Vs), relative to the row max, across the shard
    group's classes (the max and the sum of exps all-reduced; one device: as they are)."""
    m = shard.all_reduce(a.amax(-1, keepdim=True), "max").clamp_min(torch.finfo(a.dtype).min)
    a = a - m
    return a.sub_(shard.all_reduce(row_sum(a.exp(), True), "sum").log())


def divergence_rows(z_s, z_t, target, valid, inv_t, weights, opts, mdt, dz_dtype,
                    want_grad, shard=ONE_DEVICE):
    """(loss_t, divergence, entropy, dz) of a chunk: z_s, z_t (n, Vs) the student's and
    teacher's logits (of a vocabulary shard's classes: the row sums are all-reduced
    across its group); target (n,) or None; valid (n,) the tokens counted; inv_t,
    weights (n,) 1 / T and w_t. loss_t = w_t (divergence + hard_weight * CE), 0 where
    not counted; divergence and entropy 0 there too; dz (n, Vs) in dz_dtype, d
    sum(loss_t) / d z_s, or None. A counted target outside the vocabulary makes its
    token's loss NaN (nothing is read out of bounds)."""
    def total(x):  # a row sum over the whole vocabulary
        return shard.all_reduce(row_sum(x), "sum")

    a_s, da_s = capped(z_s, opts.logit_scale, opts.softcap, mdt)
    a_t, _ = capped(z_t, opts.teacher_logit_scale, opts.teacher_softcap, mdt)
    del z_t
    inv = inv_t[:, None]
    log_q = _log_softmax(a_s * inv, shard)
    log_p = _log_softmax(a_t.mul_(inv), shard)
    del a_t
    q = log_q.exp()
    entropy = -total(q * log_q)
    beta = opts.beta
    if beta == 0.0:
        p = log_p.exp()
        div = total(p * (log_p - log_q))
        grad = (q - p) if want_grad else None
    elif beta == 1.0:
        diff = log_q - log_p
        div = total(q * diff)
        grad = q * (diff - div[:, None]) if want_grad else None
    else:
        log_m = torch.logaddexp(log_q + math.log(1.0 - beta), log_p + math.log(beta))
        p = log_p.exp()
        div = beta * total(p * (log_p - log_m)) + (1.0 - beta) * total(q * (log_q - log_m))
        if want_grad:
            g = (log_q - log_m).mul_(1.0 - beta)
            grad = q * (g - total(q * g)[:, None])
        else:
            grad = None
    zero = torch.zeros_like(div)
    loss_t = div
    ce = None
    if opts.hard_weight != 0.0:
        lq1 = _log_softmax(a_s, shard)
        V = z_s.shape[1] if shard.group is None else shard.vocab_size
        col = target - shard.vocab_start  # the target's column in this shard
        here = valid & (col >= 0) & (col < z_s.shape[1])
        safe = torch.where(here, col, 0).long().unsqueeze(1)
        ce = -shard.all_reduce(torch.where(here, lq1.gather(1, safe).squeeze(1), 0.0), "sum")
        ce = torch.where(valid & ((target < 0) | (target >= V)), float("nan"), ce)
        loss_t = div + opts.hard_weight * ce
    loss_t = torch.where(valid, weights * loss_t, zero)
    if not want_grad:
        dz = None
    else:
        w = torch.where(valid, weights, zero)[:, None]
        grad = grad.mul_(inv)  # d / d a_s of the divergence
        if ce is not None:
            hard = lq1.exp_()
            hard.scatter_add_(1, safe, torch.where(here, -1.0, 0.0).to(hard.dtype)[:, None])
            grad = grad.add_(hard, alpha=opts.hard_weight)
        grad = grad.mul_(w)
        grad = grad.mul_(da_s) if da_s is not None else grad.mul_(opts.logit_scale)
        # ignored tokens: 0, also where their logits are not finite
        dz = torch.where(valid[:, None], grad, 0.0).to(dz_dtype)
    return (loss_t, torch.where(valid, div, zero), torch.where(valid, entropy, zero), dz)


ROWS = RowMath(divergence_rows, temporaries=6)

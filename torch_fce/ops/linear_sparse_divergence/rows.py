"""The sparse divergence's rows over a teacher's top-k (PyTorch, on every device).

Per token, with S the support's valid entries and s_j the student's full-vocabulary
log-softmax at j, both distributions made proper over the support as TRL 1.16's server
and async distillation trainers do (tail: a (K+1)-th bucket log(1 - sum_S exp(.)); else
each renormalised over S), then TRL's generalized JSD over it. The formula is written
once here, on the (n, K) log-probs (`_divergence`), and autograd gives its derivative
g; the Triton twin (kernels.py) writes both by hand in its row kernel and is tested
against this.
"""

import math

import torch

from ..loop.chunked import ONE_DEVICE
from ..rowmath.common import RowMath
from ..rowmath.sparse_rows import sparse_rows


def sparse_entries(support, teacher, ignore_index):
    """The support's valid entries: not ignore_index, a finite teacher log-prob."""
    return (support != ignore_index) & (teacher > -math.inf)


def impossible_entries(support, teacher, ignore_index):
    """(n, K) the entries not ignored whose teacher log-probs cannot be log-probabilities:
    NaN, +inf or above 0. Their token's divergence is NaN, never a number (TRL's formula
    gives NaN or a plausible value); the op cannot raise on values without a host sync,
    so the room counts such a token, gives it a NaN weight and its rows a stand-in."""
    return (support != ignore_index) & ~(teacher <= 0)


def counted_tokens(support, teacher, ignore_index):
    """(n,) the tokens counted: those with a valid entry or an impossible one."""
    return (sparse_entries(support, teacher, ignore_index) |
            impossible_entries(support, teacher, ignore_index)).any(-1)


def _with_tail(lp, entries, log_sum=None):
    """TRL's _add_tail_bucket: (K+1) log-probs, the last log(1 - sum exp(lp)), the sum's
    log clamped below -1e-7 (so the bucket stays finite), and its support mask. log_sum
    (n, 1): the sum's log formed elsewhere (default logsumexp(lp))."""
    if log_sum is None:
        log_sum = torch.logsumexp(lp, dim=-1, keepdim=True)
    log_sum = log_sum.clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return (torch.cat([lp, tail], dim=-1),
            torch.cat([entries, torch.ones_like(entries[..., :1])], dim=-1))


def teacher_tail(lp, entries):
    """The teacher's tail bucket (n,): the last of _with_tail's log-probs for log-probs
    lp (n, K) at the valid entries, formed in float64 (a mass near 1 would cancel in
    float32)."""
    return _with_tail(torch.where(entries, lp.double(), -math.inf), entries)[0][:, -1]


def _jsd(s, t, beta, support):
    """TRL's _jsd_divergence with a support mask, per entry: beta 0 p (log p - log q), 1
    q (log q - log p), between beta KL(p || m) + (1 - beta) KL(q || m), m = beta p +
    (1 - beta) q (log m clamped at float's tiny); masked entries 0."""
    s0, t0 = torch.where(support, s, 0.0), torch.where(support, t, 0.0)
    q, p = torch.where(support, s.exp(), 0.0), torch.where(support, t.exp(), 0.0)
    if beta == 0.0:
        return torch.nan_to_num(p * (t0 - s0), nan=0.0)
    if beta == 1.0:
        return torch.nan_to_num(q * (s0 - t0), nan=0.0)
    tiny = torch.finfo(s.dtype).tiny
    m = torch.where(support, torch.log(((1 - beta) * q + beta * p).clamp_min(tiny)), 0.0)
    return beta * torch.nan_to_num(p * (t0 - m), nan=0.0) + \
        (1 - beta) * torch.nan_to_num(q * (s0 - m), nan=0.0)


def _divergence(s, t, entries, opts, tail_t=None, log_sum=None):
    """Each token's divergence (n,) from the student's and the teacher's log-probs at
    the support (n, K), only valid entries read (every token has one); with the tail,
    tail_t (n,) the teacher's bucket (teacher_tail) and log_sum the student's support
    log-mass (_with_tail)."""
    neg_inf = torch.full((), -math.inf, dtype=s.dtype, device=s.device)
    s, t = torch.where(entries, s, neg_inf), torch.where(entries, t, neg_inf)
    if opts.tail:
        s, support = _with_tail(s, entries, log_sum)
        t = torch.cat([t, tail_t[:, None].to(t.dtype)], dim=-1)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
        support = entries
    return _jsd(s, t, opts.beta, support).sum(-1)


def _sparse_terms(log_q, teacher, tail_t, entries, weights, opts, log_mass=None):
    """(loss_t, g, divergence, mass) of a chunk, each (n,) but g (n, K): the weighted
    loss term, its derivative w.r.t. the student's support log-probs, the divergence and
    the student's mass on the support, 0 at tokens not counted; tail_t the teacher's
    tail bucket (n,) with the tail (else None). With log_mass (n,), the log of the
    student's mass on the entries formed precisely (sparse_rows' rest_of), the tail's
    log-mass is a variable of its own and g is (g_e, g_l): the derivatives w.r.t. the
    log-probs with it fixed, and w.r.t. it (n, 1) (the rows form its chain to the
    logits without cancellation). Autograd differentiates `_divergence` on these
    (n, K) tensors below the op's own autograd (inference_mode(False) lifts the
    dispatcher's exclusion of the autograd keys; the tensors entering the small graph
    are cloned)."""
    counted = entries.any(-1)
    # a token without valid entries reads one dummy entry (its results are zeroed)
    first = torch.zeros_like(entries)
    first[:, :1] = True
    safe = torch.where(counted[:, None], entries, first)
    mdt = log_q.dtype
    with torch.inference_mode(False), torch.enable_grad():
        s = log_q.clone().requires_grad_()
        t = torch.where(safe & ~entries, 0.0, teacher.to(mdt)).clone()
        leaves = [s]
        if log_mass is not None:  # NaN where an entry's log-prob is (out of range)
            nan = torch.where(safe, log_q, 0.0).isnan().any(-1)
            leaves.append(torch.where(nan, math.nan, log_mass.to(mdt))[:, None]
                          .clone().requires_grad_())
        div = _divergence(s, t, safe, opts, tail_t, *leaves[1:])
        w = torch.where(counted, weights.to(mdt), 0.0).clone()
        loss_t = w * torch.where(counted, div, 0.0)
        g, *g_l = torch.autograd.grad(loss_t.sum(), leaves)
    zero = torch.zeros_like(w)
    mass = torch.where(entries, log_q.exp(), 0.0).sum(-1)
    g = torch.where(entries, g, 0.0)
    if g_l:
        g = (g, torch.where(counted[:, None], g_l[0], 0.0))
    return (loss_t.detach(), g, torch.where(counted, div.detach(), zero),
            torch.where(counted, mass, zero))


def sparse_divergence_rows(z, support, teacher, tail_t, inv_t, weights, opts, mdt,
                           dz_dtype, want_grad, shard=ONE_DEVICE):
    """((loss_t, divergence, student_mass, entropy), dz) of a chunk's sparse divergence:
    z (n, V) the logits (a vocabulary shard's: as sparse_rows'), support and teacher
    (n, K) the teacher's classes and log-probs, tail_t (n,) in mdt the teacher's tail
    bucket with the tail (teacher_tail, formed once a call; else None), inv_t, weights
    (n,) 1 / T and w_t; opts a SparseDivOptions. The results are 0 at a token without
    valid entries, and dz exactly 0 there; a valid entry outside [0, V) makes its
    token's results NaN (nothing is read out of bounds). Without the tail dz is a
    SparseGrad: both distributions renormalised over the support, the loss reads only
    the support's logits (its g sums to 0, no softmax part). Overwrites z where it can."""
    V = z.shape[1] if shard.group is None else shard.vocab_size
    entries = sparse_entries(support, teacher, opts.ignore_index)
    bad = entries & ((support < 0) | (support >= V))
    safe = torch.where(entries & ~bad, support, 0).long()

    def terms(log_q, log_mass=None):
        return _sparse_terms(torch.where(bad, math.nan, log_q), teacher, tail_t, entries,
                             weights, opts, log_mass)

    (loss_t, div, mass, ent), dz = sparse_rows(
        z, safe, inv_t, terms, mdt, dz_dtype, want_grad, opts.logit_scale, opts.softcap,
        entropy=True, shard=shard, dense=opts.tail,
        rest_of=entries & ~bad if opts.tail else None)
    # the divergence's nan_to_num would hide the NaN of an out-of-range entry: set it
    nan = bad.any(-1)
    return (torch.where(nan, math.nan, loss_t), torch.where(nan, math.nan, div), mass,
            torch.where(entries.any(-1), ent, 0.0)), dz


ROWS = RowMath(sparse_divergence_rows, temporaries=3)

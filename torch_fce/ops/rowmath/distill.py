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
from typing import Callable, NamedTuple

import torch

from ..loop.chunked import ONE_DEVICE, logits_bytes, math_dtype_for
from ..loop.sparse import SparseGrad
from .ce import row_sum


class RowMath(NamedTuple):
    """A row function on one backend, how many float32 (n, V) temporaries it allocates
    beyond the chunk's logits and dz (the workspace's bytes per logit count them),
    whether it writes dz over wider logits too (triton/ce.dz_over) and whether it runs
    on a vocabulary shard (its `shard` argument)."""
    rows: Callable
    temporaries: int
    dz_over: bool = False
    shards: bool = True

    def per_logit(self, logits_dtype, dtype):
        """A chunk's bytes per logit: the logits, the temporaries and dz (in the inputs'
        dtype) where it has a buffer of its own (logits wider than the inputs, unless
        written over them)."""
        return logits_bytes(logits_dtype, logits_dtype if self.dz_over else dtype) + \
            self.temporaries * math_dtype_for(dtype).itemsize


class DistillRows(NamedTuple):
    """The distillation family on one backend:
      divergence(z_s, z_t, target, valid, inv_t, weights, opts, math_dtype, dz_dtype,
                 want_grad) -> (loss_t, divergence, entropy, dz): divergence_rows'
      sparse(z, idx, inv_t, terms, math_dtype, dz_dtype, want_grad, logit_scale,
             softcap) -> (out, dz): sparse_rows'
      sparse_divergence(z, support, teacher, teacher_tail, inv_t, weights, opts,
                        math_dtype, dz_dtype, want_grad) -> (out, dz):
                        sparse_divergence_rows'
    each a RowMath; `on` gives a vocabulary layout's members."""
    divergence: RowMath
    sparse: RowMath
    sparse_divergence: RowMath

    def on(self, shard):
        """The family for a vocabulary layout: the backend's on one device; across a
        shard group its members that run on a shard, the PyTorch rows for the others."""
        if shard.group is None:
            return self
        return DistillRows(*(mine if mine.shards else torch_rows
                             for mine, torch_rows in zip(self, TORCH_DISTILL_ROWS)))


def capped(z, scale, cap, mdt):
    """(softcap(scale * z) in mdt, d a / d z or None when it is the scale itself)."""
    a = z.to(mdt) * scale
    if cap is None:
        return a, None
    a = torch.tanh(a / cap).mul_(cap)
    return a, (1.0 - (a / cap) ** 2) * scale


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


def sparse_targets(idx, probs, V, ignore_index, mdt):
    """(skip, valid, safe, p) of a chunk's sparse targets: the entries skipped, the
    tokens counted, the indices made safe to read (skipped and out-of-range ones at 0)
    and the probabilities in mdt (0 where skipped, NaN where the index is outside [0,
    V): that token's loss is NaN)."""
    skip = idx == ignore_index
    bad = ~skip & ((idx < 0) | (idx >= V))
    p = torch.where(skip, 0.0, torch.where(bad, float("nan"), probs.to(mdt)))
    return skip, ~skip.all(-1), torch.where(skip | bad, 0, idx).long(), p


def class_sums(idx, g):
    """(n, k): each entry's sum of g over the entries of its row naming the same class
    (duplicates), from a sort of the k indices (no (n, k, k) temporary)."""
    k = idx.shape[1]
    sorted_idx, order = torch.sort(idx, dim=-1, stable=True)
    pos = torch.arange(k, device=idx.device).expand_as(idx)
    new = torch.ones_like(sorted_idx, dtype=torch.bool)
    new[:, 1:] = sorted_idx[:, 1:] != sorted_idx[:, :-1]
    first = torch.where(new, pos, 0).cummax(-1).values  # each run's first position
    sums = torch.zeros_like(g).scatter_add_(1, first, g.gather(1, order))
    return torch.empty_like(g).scatter_(1, order, sums.gather(1, first))


def sparse_rows(z, idx, inv_t, terms, mdt, dz_dtype, want_grad, logit_scale=1.0,
                softcap=None, entropy=False, shard=ONE_DEVICE, dense=True, rest_of=None):
    """(out, dz) of a loss over a few classes of each row, the support idx (n, k) of
    whole-vocabulary classes (made safe to read): with a = softcap(logit_scale * z),
    u = a / T and log q = log_softmax(u), terms(log_q[idx]) gives (loss_t, g, *stats)
    with g = d loss_t / d log_q[idx] (n, k); out is (loss_t, *stats), and with entropy
    the rows' entropy -sum q log q after them; and
        d loss_t / d u = scatter(g) - (sum_k g_k) q,
    times d u / d z = softcap'(.) logit_scale / T (dz None without want_grad; dense
    False: a loss whose g sums to 0, its dz the SparseGrad of scatter(g) alone). log q is
    formed relative to the row max, so a confident row keeps float32 precision (not
    lse's). rest_of (n, k) bool, the entries a rest leaves out: terms(log_q, log_mass)
    then gets the log of their mass (each entry counted, as TRL's tail bucket counts
    them) with the rest 1 - mass formed as the sum of q over the other classes less the
    duplicates' excess, precise where the entries hold nearly all the mass (1 - sum
    would cancel), and gives g as (g_e, g_l) (_sparse_terms). A vocabulary shard's z
    holds its classes: the max, the sum of exps and each support class's u (from the
    shard holding it) are all-reduced before terms, which every rank forms alike; its
    dz is its own classes'. A row whose g is all 0 (a token not counted) gets dz exactly
    0, also where its logits are not finite (the callers need no pass of their own).
    Overwrites z where it can."""
    a, da = capped(z, logit_scale, softcap, mdt) if logit_scale != 1.0 or softcap \
        is not None else (z.to(mdt), None)
    u = a.mul_(inv_t[:, None])
    m = shard.all_reduce(u.amax(-1, keepdim=True), "max").clamp_min(torch.finfo(mdt).min)
    col = idx - shard.vocab_start  # each support class's column in this shard
    here = (col >= 0) & (col < u.shape[1])
    col = torch.where(here, col, 0)
    u_k = shard.all_reduce(torch.where(here, u.gather(1, col), 0.0), "sum") \
        if shard.group is not None else u.gather(1, col)
    e = u.sub_(m).exp_()  # u is consumed from here on
    total = shard.all_reduce(row_sum(e, True), "sum")
    log_q = (u_k - m) - total.log()
    if rest_of is None:
        loss_t, g, *stats = terms(log_q)
        g_l = torch.zeros_like(g[:, :1])
    else:
        mult = class_sums(idx, rest_of.to(mdt))  # the valid entries naming each one's class
        out = rest_of & here
        member = torch.zeros_like(e, dtype=torch.uint8).scatter_reduce_(
            1, col, out.to(torch.uint8), "amax").bool()
        excess = torch.where(out, e.gather(1, col) * (1.0 - 1.0 / mult), 0.0)
        rest = shard.all_reduce(row_sum(torch.where(member, 0.0, e), True) -
                                row_sum(excess, True), "sum") / total
        # the entries' log-mass log(1 - rest): from the rest where it is small, from the
        # entries' log-probs elsewhere (each precise there)
        log_mass = torch.where(rest < 0.5, torch.log1p(-rest), torch.logsumexp(
            torch.where(rest_of, log_q, -math.inf), -1, keepdim=True))
        loss_t, (g, g_l), *stats = terms(log_q, log_mass[:, 0])
    if entropy:  # log S - sum e log e / S, e = exp(u - m), S = sum e (0 log 0 = 0)
        xlx = shard.all_reduce(row_sum(torch.special.xlogy(e, e), True), "sum")
        stats.append((total.log() - xlx / total)[:, 0])
    if not want_grad:
        return (loss_t, *stats), None
    c = inv_t[:, None] * logit_scale  # d u / d (logit_scale z), times logit_scale
    if not dense:
        vals = g * c
        if da is not None:
            vals = vals * da.gather(1, col) / logit_scale
        return (loss_t, *stats), SparseGrad(col, torch.where(here & (g != 0), vals, 0.0))
    coef = -(g.sum(-1, keepdim=True) + g_l) * c
    dz = e.mul_(coef / total)
    if rest_of is None:
        dz.scatter_add_(1, col, torch.where(here, g * c, 0.0))
    else:
        # the support classes' values written whole: through the rest, g_l's part of the
        # softmax term and of the entries' cancel to -g_l q (one entry a class), which
        # their sum would leave at float32's rounding of g_l q / rest
        q_k = log_q.exp()
        sig = (log_q - log_mass).exp()  # q / (1 - rest): d log(1 - rest) / d u
        exact = c * (class_sums(idx, g) - q_k * g.sum(-1, keepdim=True) +
                     torch.where(mult > 0, g_l * (mult - 1.0 + rest) * sig, 0.0))
        scatter_whole(dz, col, here, torch.where(mult > 0, exact, coef * q_k))
    if da is not None:  # softcap'(.): da is d a / d z, the scale included
        dz = dz.mul_(da / logit_scale)
    zero = (g == 0).all(-1, keepdim=True) & (g_l == 0)
    return (loss_t, *stats), dz.masked_fill_(zero, 0.0).to(dz_dtype)


def scatter_whole(dz, col, here, values):
    """dz[col] = values at the entries here (entries naming one class carry one value);
    an entry not here writes the value of its row's first entry here, or with none, the
    value already at its column (every write to a column one value: no race)."""
    first = here.int().argmax(-1, keepdim=True)
    col = torch.where(here, col, col.gather(1, first))
    other = torch.where(here.any(-1, keepdim=True), values.gather(1, first), dz.gather(1, col))
    dz.scatter_(1, col, torch.where(here, values, other))


def soft_ce_rows(z, idx, probs, inv_t, weights, opts, mdt, dz_dtype, want_grad,
                 sparse=sparse_rows, shard=ONE_DEVICE):
    """(loss_t, dz) of a chunk's cross entropy to sparse targets: z (n, V) the logits,
    idx and probs (n, k) the targets' classes and probabilities (an index equal to
    opts.ignore_index is skipped, a token with every index skipped not counted), inv_t,
    weights (n,) 1 / T and w_t: loss_t = -w_t sum_k p_k log q[idx_k], so g = -w_t p
    (`sparse`, the backend's sparse_rows, forms dz). An index outside [0, V) makes its
    token's loss NaN (nothing is read out of bounds). A vocabulary shard's: as
    sparse_rows'. Overwrites z where it can."""
    V = z.shape[1] if shard.group is None else shard.vocab_size
    skip, valid, safe, p = sparse_targets(idx, probs, V, opts.ignore_index, mdt)
    w = torch.where(valid, weights, 0.0)[:, None]

    def terms(log_q):
        return -(w[:, 0] * torch.where(skip, 0.0, p * log_q).sum(-1)), -w * p

    (loss_t,), dz = sparse(z, safe, inv_t, terms, mdt, dz_dtype, want_grad, shard=shard)
    return loss_t, dz  # a token not counted has g = 0: dz exactly 0


# ---- the sparse divergence over a teacher's top-k (linear_sparse_divergence) --------
# Per token, with S the support's valid entries and s_j the student's full-vocabulary
# log-softmax at j, both distributions made proper over the support as TRL 1.16's
# server and async distillation trainers do (tail: a (K+1)-th bucket log(1 - sum_S
# exp(.)); else each renormalised over S), then TRL's generalized JSD over it. The
# formula is written once here, on the (n, K) log-probs (`_divergence`), and autograd
# gives its derivative g; the Triton twin (rowmath/triton/distill.py) writes both by
# hand in its row kernel and is tested against this.

def sparse_entries(support, teacher, ignore_index):
    """The support's valid entries: not ignore_index, a finite teacher log-prob."""
    return (support != ignore_index) & (teacher > -math.inf)


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


TORCH_DISTILL_ROWS = DistillRows(RowMath(divergence_rows, temporaries=6),
                                 RowMath(sparse_rows, temporaries=2),
                                 RowMath(sparse_divergence_rows, temporaries=3))

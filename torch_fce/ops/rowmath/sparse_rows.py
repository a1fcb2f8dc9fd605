"""The logits gradient of any loss over a few classes of each row (PyTorch, on every
device): the sparse-target cross entropy's and the sparse divergence's rows build on
sparse_rows, their Triton twin in sparse_rows_kernels.py."""

import math

import torch

from ..loop.chunked import ONE_DEVICE
from ..loop.sparse import SparseGrad
from .common import RowMath, capped, row_sum


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


ROWS = RowMath(sparse_rows, temporaries=2)

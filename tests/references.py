"""The float64 references, one per op, in one home: each op's semantics composed from
the explicit logits (materialised, in float64 unless asked otherwise), independently of
the library's code. Tests compare the ops against them; nothing in torch_fce imports
them.
    linear_ce_reference / logits_ce_reference   the cross entropy (docs/api.md)
    logprobs_reference                          log-probs, entropy, lse, argmax
    policy_reference                            the policy losses, as TRL's GRPOTrainer
    distillation_reference                      the generalized JSD and hard loss
    soft_ce_reference                           the cross entropy to sparse targets
    topk_reference                              a teacher's top-k log-probs
    sparse_divergence_reference                 the divergence over a teacher's top-k
                                                (add_tail_bucket, jsd_divergence: TRL's)
"""

import math

import torch
import torch.nn.functional as F


def logits_ce_reference(z, target, class_weight=None, *, ignore_index=-100,
                        reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
    """F.cross_entropy (+ softcap, + z-loss) of logits z (N, V) in z's dtype."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = target.long()
    cw = None if class_weight is None else class_weight.to(z.dtype)
    loss = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss > 0.0:
        valid = t != ignore_index
        zl = torch.where(valid, torch.logsumexp(z, -1) ** 2, 0.0) * z_loss
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / valid.sum()}[reduction]
    return loss


def linear_ce_reference(hidden, weight, target, bias=None, class_weight=None, *,
                        products_dtype=None, math_dtype=torch.float64, **options):
    """F.linear + F.cross_entropy (+ z-loss) with math in math_dtype.

    products_dtype: run F.linear in this dtype and round the logits to it before the
    math (what the op does with low-precision inputs); None runs it in math_dtype.
    hidden (*, D), weight (V, D), target (*). Returns () or target.shape.
    """
    pd = products_dtype or math_dtype
    b = None if bias is None else bias.to(pd)
    z = F.linear(hidden.to(pd), weight.to(pd), b).to(math_dtype)
    loss = logits_ce_reference(z.reshape(-1, weight.shape[0]), target.reshape(-1),
                               class_weight, **options)
    return loss.reshape(target.shape) if options.get("reduction") == "none" else loss


def sampler_kept(z, top_k=None, top_p=None, min_p=None):
    """The classes vLLM's sampler keeps (a bool mask of z's shape), row by row in Python
    from its rules: on processed logits z, min_p on the probabilities (p_j >= min_p
    p_max), then the top_k first of the order (z descending, class ascending), then
    top_p over those renormalised: a class kept while the mass before it is < top_p
    (top_p = 1: every class, as vLLM's mask of the mass from the bottom <= 1 - top_p)."""
    flat = z.detach().double().reshape(-1, z.shape[-1]).cpu()
    keep = torch.zeros(flat.shape, dtype=torch.bool)
    for i, row in enumerate(flat):
        order = sorted(range(len(row)), key=lambda j: (-row[j].item(), j))
        if min_p is not None:
            p = row.softmax(-1)
            order = [j for j in order if p[j] >= min_p * p.max()]
        if top_k is not None:
            order = order[:top_k]
        if top_p is not None and top_p < 1.0:  # 1 keeps all (a float sum of the
            # probabilities before the last classes can round to 1 and drop them)
            q, before, kept = row[order].softmax(-1).tolist(), 0.0, []
            for j, qj in zip(order, q):
                if before < top_p:
                    kept.append(j)
                before += qj
            order = kept
        keep[i, order] = True
    return keep.reshape(z.shape).to(z.device)


def _truncated_log_softmax(z, target, valid, truncation):
    """(log-probs at target, entropy) of z's rows, over the sampler's kept set where
    truncation (its top_k, top_p, min_p) asks: -inf, without gradient, at a target outside
    it."""
    keep = sampler_kept(z, **truncation) if truncation else torch.ones_like(z, dtype=torch.bool)
    logp = torch.where(keep, z, float("-inf")).log_softmax(-1)
    safe = torch.where(valid, target, 0).long()[..., None]
    lp = logp.gather(-1, safe).squeeze(-1)
    lp = torch.where(keep.gather(-1, safe).squeeze(-1), lp, float("-inf"))
    ent = -torch.where(keep, logp.exp() * torch.where(keep, logp, 0.0), 0.0).sum(-1)
    return lp, ent, keep


def logprobs_reference(hidden, weight, target, bias=None, temperature=1.0, softcap=None,
              ignore_index=-100, **truncation):
    """(logprob, entropy, lse, argmax) from float64 logits, each target.shape; under the
    sampler's truncation (top_k, top_p, min_p) those of its distribution."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = torch.as_tensor(temperature, dtype=torch.float64, device=z.device)
    z = z / t.expand(target.shape)[..., None]
    valid = target != ignore_index
    lp, ent, keep = _truncated_log_softmax(z, target, valid, truncation)
    zero = torch.zeros((), dtype=torch.float64, device=z.device)
    return (torch.where(valid, lp, zero), torch.where(valid, ent, zero),
            torch.logsumexp(torch.where(keep, z, float("-inf")), -1), z.argmax(-1))


def policy_reference(leaves, target, advantages, old=None, ref=None, token_weights=None,
              temperature=1.0, softcap=None, loss_type="clip", epsilon_low=0.2,
              epsilon_high=None, delta=None, sapo_temperature_pos=1.0,
              sapo_temperature_neg=1.05, beta=0.0, kl="k3", kl_ratio=False,
              entropy_coef=0.0, ignore_index=-100, **truncation):
    """(loss, logprob, entropy) in float64 from the logits, as TRL's GRPOTrainer writes
    the per-token terms, differentiable w.r.t. the leaves (hidden, weight, bias)."""
    hi = epsilon_low if epsilon_high is None else epsilon_high
    h, w, b = leaves["hidden"], leaves["weight"], leaves.get("bias")
    z = F.linear(h, w, b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / torch.as_tensor(temperature, dtype=z.dtype, device=z.device).expand(
        target.shape)[..., None]
    valid = target != ignore_index
    lp, ent, _ = _truncated_log_softmax(z, target, valid, truncation)
    A = advantages.double().expand(target.shape)
    if old is None:  # 1, with lp's derivative (at -inf: 1, none)
        lp0 = torch.where(lp > float("-inf"), lp, 0.0)
        r = torch.exp(lp0 - lp0.detach())
    else:
        r = torch.exp(lp - old.double())
    if loss_type == "clip":
        coef_2 = torch.clamp(r, 1 - epsilon_low, 1 + hi)
        coef_1 = r if delta is None else torch.clamp(r, max=delta)
        per = -torch.min(coef_1 * A, coef_2 * A)
    elif loss_type == "cispo":
        per = -torch.clamp(r, max=hi).detach() * A * lp
    elif loss_type == "sapo":
        tau = torch.where(A > 0, sapo_temperature_pos, sapo_temperature_neg).double()
        per = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A
    else:
        per = -r * A
    if ref is not None:
        d = ref.double() - lp
        per_kl = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[kl]
        per = per + beta * (per_kl * r if kl_ratio else per_kl)  # TRL's bias correction
    per = per - entropy_coef * ent
    wt = valid.double() / valid.sum().clamp(min=1) if token_weights is None else \
        token_weights.double()
    loss = torch.where(valid, wt * per, 0.0).sum()
    return loss, torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def distillation_reference(h, w, b, ht, wt, bt, target, beta=0.0, temperature=1.0, hard_weight=0.0,
              token_weights=None, logit_scale=1.0, teacher_logit_scale=1.0, softcap=None,
              teacher_softcap=None, ignore_index=-100, wide=torch.float64):
    """(loss, divergence, entropy) from explicit logits (in `wide`), TRL's formulas."""
    zs = F.linear(h, w, b).to(wide) * logit_scale
    zt = F.linear(ht, wt, bt).to(wide) * teacher_logit_scale
    if softcap is not None:
        zs = softcap * torch.tanh(zs / softcap)
    if teacher_softcap is not None:
        zt = teacher_softcap * torch.tanh(zt / teacher_softcap)
    T = torch.as_tensor(temperature, dtype=wide, device=zs.device).expand(zs.shape[:-1])
    lq, lp = (zs / T[..., None]).log_softmax(-1), (zt / T[..., None]).log_softmax(-1)
    if beta == 0.0:
        div = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:
        div = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    else:  # TRL's generalized_jsd_loss
        lm = torch.logsumexp(torch.stack([lq + math.log(1 - beta), lp + math.log(beta)]), 0)
        div = beta * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1) + \
            (1 - beta) * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
    ent = -(lq.exp() * lq).sum(-1)
    valid = torch.ones(zs.shape[:-1], dtype=torch.bool, device=zs.device) \
        if target is None else target != ignore_index
    per = div
    if hard_weight:
        safe = torch.where(valid, target, 0)
        per = per - hard_weight * zs.log_softmax(-1).gather(-1, safe[..., None]).squeeze(-1)
    wts = valid.to(wide) / valid.sum().clamp(min=1) if token_weights is None \
        else token_weights.to(wide)
    zero = torch.zeros_like(div)
    return (torch.where(valid, wts * per, zero).sum(), torch.where(valid, div, zero),
            torch.where(valid, ent, zero))


def soft_ce_reference(h, w, b, idx, probs, temperature=1.0, token_weights=None, ignore_index=-100,
              wide=torch.float64):
    """The loss from explicit logits in `wide`."""
    z = F.linear(h, w, b).to(wide)
    T = torch.as_tensor(temperature, dtype=wide, device=z.device).expand(z.shape[:-1])
    log_q = (z / T[..., None]).log_softmax(-1)
    skip = idx == ignore_index
    valid = ~skip.all(-1)
    per = -torch.where(skip, 0.0, probs.to(wide) * log_q.gather(-1, idx.clamp(min=0))).sum(-1)
    wts = valid.to(wide) / valid.sum().clamp(min=1) if token_weights is None \
        else token_weights.to(wide)
    return torch.where(valid, wts * per, 0.0).sum()


def topk_reference(hidden, weight, k, bias=None, target=None, temperature=1.0,
                   logit_scale=1.0, softcap=None, ignore_index=-100):
    """(indices, logprobs, target_logprob) of the float64 log-softmax of
    softcap(logit_scale * logits) / T: a full stable sort of each row by value
    descending (equal values by ascending class), its first k."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = torch.as_tensor(temperature, dtype=torch.float64, device=z.device)
    logp = (z / t.expand(z.shape[:-1])[..., None]).log_softmax(-1)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[..., :k]
    target_lp = None
    if target is not None:
        valid = target != ignore_index
        target_lp = torch.where(
            valid, logp.gather(-1, torch.where(valid, target, 0)[..., None])[..., 0], 0.0)
    return order, logp.gather(-1, order), target_lp


def add_tail_bucket(log_probs, valid_mask):
    """TRL 1.16's _add_tail_bucket (trl/experimental/server_distillation): a (K+1)-th
    entry log(1 - sum exp(log_probs)), the sum's log clamped below -1e-7, and its mask
    (tests/integrations/test_trl_topk_distill.py holds the copy to TRL's own)."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return (torch.cat([log_probs, tail], dim=-1),
            torch.cat([valid_mask, torch.ones_like(valid_mask[..., :1])], dim=-1))


def jsd_divergence(student_log_probs, teacher_log_probs, beta, support_mask):
    """TRL 1.16's _jsd_divergence with a support mask, per entry: beta 0 KL(p || q), 1
    KL(q || p), between the mixture's (log m clamped at tiny); masked entries 0 (held to
    TRL's own as add_tail_bucket)."""
    s, t, mask = student_log_probs, teacher_log_probs, support_mask
    s0, t0 = torch.where(mask, s, 0.0), torch.where(mask, t, 0.0)
    q, p = torch.where(mask, s.exp(), 0.0), torch.where(mask, t.exp(), 0.0)
    if beta == 0.0:
        return torch.nan_to_num(p * (t0 - s0), nan=0.0)
    if beta == 1.0:
        return torch.nan_to_num(q * (s0 - t0), nan=0.0)
    tiny = torch.finfo(s.dtype).tiny
    m = torch.where(mask, torch.log(((1 - beta) * q + beta * p).clamp_min(tiny)), 0.0)
    return beta * torch.nan_to_num(p * (t0 - m), nan=0.0) + \
        (1 - beta) * torch.nan_to_num(q * (s0 - m), nan=0.0)


def sparse_divergence_reference(hidden, weight, support, teacher_lp, bias=None, beta=0.0,
                                tail=False, temperature=1.0, logit_scale=1.0, softcap=None,
                                token_weights=None, ignore_index=-100):
    """(loss, divergence, student_mass, entropy) in float64 as TRL 1.16's server
    distillation forms them (_compute_server_forward_kl_loss, _add_tail_bucket,
    _jsd_divergence with a support mask) from the student's full log-softmax,
    differentiable w.r.t. hidden, weight and bias; a support entry equal to ignore_index
    is invalid too, a token without valid entries not counted; token_weights None: 1 /
    the tokens counted."""
    z = F.linear(hidden, weight, bias).double() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    T = torch.as_tensor(temperature, dtype=torch.float64, device=z.device)
    log_q = (z / T.expand(z.shape[:-1])[..., None]).log_softmax(-1)
    teacher_lp = teacher_lp.double()
    valid = (support != ignore_index) & (teacher_lp > float("-inf"))
    counted = valid.any(-1)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=z.device)
    s = torch.where(valid, log_q.gather(-1, torch.where(valid, support, 0)), neg_inf)
    t = torch.where(valid, teacher_lp, neg_inf)
    # a token not counted gets one dummy entry (its divergence is dropped below)
    dummy = torch.zeros_like(valid)
    dummy[..., 0] = True
    mask = torch.where(counted[..., None], valid, dummy)
    s = torch.where(mask & ~valid, 0.0, s)
    t = torch.where(mask & ~valid, 0.0, t)

    if tail:
        (s, tail_mask), (t, _) = add_tail_bucket(s, mask), add_tail_bucket(t, mask)
        mask = tail_mask
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    div = torch.where(counted, jsd_divergence(s, t, beta, mask).sum(-1), 0.0)
    w = counted.double() / counted.sum().clamp(min=1) if token_weights is None \
        else token_weights.double()
    mass = torch.where(valid, log_q.gather(-1, torch.where(valid, support, 0)).exp(), 0.0)
    entropy = -(log_q.exp() * log_q).sum(-1)  # the async trainer's entropy metric
    return (torch.where(counted, w * div, 0.0).sum(), div.detach(),
            torch.where(counted, mass.sum(-1), 0.0).detach(),
            torch.where(counted, entropy, 0.0).detach())

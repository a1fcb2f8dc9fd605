"""Per-token policy-loss math (linear_policy_loss): each token's loss term and its
derivatives with respect to the token's log-prob and entropy, from (n,) vectors.

The loss is sum_t w_t * (policy_t + beta * kl_t - entropy_coef * entropy_t) over the
tokens not ignored, with r_t = exp(logprob_t - old_t) (1 without old log-probs, with
the derivative of exp(logprob - logprob.detach())), A_t the advantage and, as TRL 1.16's
GRPOTrainer writes them at token-level importance sampling:
  clip       -min(min(r, delta) * A, clamp(r, 1 - eps_low, 1 + eps_high) * A)
  cispo      -min(r, eps_high).detach() * A * logprob
  sapo       -sigmoid(tau (r - 1)) * 4 / tau * A,  tau = tau_pos if A > 0 else tau_neg
  reinforce  -r * A
  kl: k1 logprob - ref, k2 (logprob - ref)^2 / 2, k3 exp(ref - logprob) - (ref - logprob) - 1,
  times r with kl_ratio (TRL's use_bias_correction_kl; r differentiated as above)
  (with beta 0 a statistic only)
The derivatives are written out (torch's: min splits a tie's gradient in halves, clamp
passes it at its bounds), so the chunk loop forms the logits gradient in the forward:
dz = g_lp * dlogprob/dz + g_h * dentropy/dz, with the log-probs' row math.
"""

from typing import NamedTuple, Optional

import torch

from .checks import (_float, _got, check_inputs, check_logprob_options,
                     check_per_token)

LOSS_TYPES = ("clip", "cispo", "sapo", "reinforce")
KL_ESTIMATORS = ("k1", "k2", "k3")


class PolicyOptions(NamedTuple):
    loss_type: str
    epsilon_low: float
    epsilon_high: float
    delta: Optional[float]
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    beta: float
    kl: str
    kl_ratio: bool
    entropy_coef: float


def policy_terms(logprob, entropy, valid, advantages, old, ref, weights, opts):
    """(loss_t, g_lp, g_h, ratio, clipped, kl) each (n,): the weighted loss term of each
    token and its derivatives w.r.t. the token's log-prob and entropy; 0 at ignored
    tokens. old and ref may be None; weights are the tokens' w_t."""
    zero = torch.zeros_like(logprob)
    lp = torch.where(valid, logprob, zero)  # ignored tokens: no NaN from their logits
    A = advantages.to(lp.dtype)
    r = torch.ones_like(lp) if old is None else torch.exp(lp - old.to(lp.dtype))
    if opts.loss_type == "clip":
        low, high = 1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high
        c1 = r if opts.delta is None else torch.clamp(r, max=opts.delta)
        dc1 = r if opts.delta is None else torch.where(r <= opts.delta, r, zero)
        c2 = torch.clamp(r, low, high)
        dc2 = torch.where((r >= low) & (r <= high), r, zero)
        a, b = c1 * A, c2 * A
        term = -torch.minimum(a, b)
        d_term = -torch.where(a < b, dc1 * A, torch.where(a > b, dc2 * A,
                                                          0.5 * (dc1 + dc2) * A))
        clipped = ((c1 < low) & (A < 0)) | ((c1 > high) & (A > 0))
    elif opts.loss_type == "cispo":
        cap = torch.clamp(r, max=opts.epsilon_high)
        term, d_term = -cap * A * lp, -cap * A
        clipped = (r > opts.epsilon_high) & (A > 0)  # TRL's cispo_clip_ratio
    elif opts.loss_type == "sapo":
        # fills, not host-to-device copies (which a CUDA graph capture refuses)
        tau = torch.where(A > 0, torch.full_like(lp, opts.sapo_temperature_pos),
                          torch.full_like(lp, opts.sapo_temperature_neg))
        sig = torch.sigmoid(tau * (r - 1.0))
        term = -sig * 4.0 / tau * A
        d_term = -4.0 * A * sig * (1.0 - sig) * r
        clipped = torch.zeros_like(valid)
    else:  # reinforce
        term, d_term = -r * A, -r * A
        clipped = torch.zeros_like(valid)
    kl = d_kl = zero
    if ref is not None:
        diff = lp - ref.to(lp.dtype)
        if opts.kl == "k1":
            kl, d_kl = diff, torch.ones_like(diff)
        elif opts.kl == "k2":
            kl, d_kl = 0.5 * diff * diff, diff
        else:
            kl, d_kl = torch.exp(-diff) + diff - 1.0, 1.0 - torch.exp(-diff)
        if opts.kl_ratio:  # d(r kl) = r (d_kl + kl): dr/dlogprob = r
            kl, d_kl = r * kl, r * (d_kl + kl)
    w = torch.where(valid, weights.to(lp.dtype), zero)
    ent = torch.where(valid, entropy, zero)
    if opts.beta != 0.0:  # with beta 0 the KL is a statistic only (0 * inf would be NaN)
        term, d_term = term + opts.beta * kl, d_term + opts.beta * d_kl
    loss_t = w * (term - opts.entropy_coef * ent)
    g_lp = w * d_term
    g_h = w * -opts.entropy_coef
    return (torch.where(valid, loss_t, zero), g_lp, g_h, torch.where(valid, r, zero),
            (clipped & valid).to(lp.dtype), torch.where(valid, kl, zero))


def token_weights(token_weights, valid, dtype):
    """w_t: the given weights, or 1 / (number of tokens not ignored) (1 when none is)."""
    if token_weights is not None:
        return token_weights.to(dtype)
    return valid.to(dtype) / valid.sum().clamp_min(1).to(dtype)


def check_policy_options(loss_type, epsilon_low, epsilon_high, delta, sapo_temperature_pos,
                         sapo_temperature_neg, beta, kl, kl_ratio, entropy_coef):
    """Raises naming the option; returns PolicyOptions (epsilon_high defaults to
    epsilon_low)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl not in KL_ESTIMATORS:
        raise ValueError(f"kl must be one of {KL_ESTIMATORS}, got {kl!r}")
    if not 0.0 <= _float("epsilon_low", epsilon_low) < float("inf"):
        raise ValueError(f"epsilon_low must be a finite float >= 0{_got(epsilon_low)}")
    if epsilon_high is None:
        epsilon_high = epsilon_low
    if not 0.0 <= _float("epsilon_high", epsilon_high) < float("inf"):
        raise ValueError(f"epsilon_high must be None or a finite float >= 0"
                         f"{_got(epsilon_high)}")
    if delta is not None and not 0.0 < _float("delta", delta) < float("inf"):
        raise ValueError(f"delta must be None or a finite float > 0{_got(delta)}")
    for name, value in (("sapo_temperature_pos", sapo_temperature_pos),
                        ("sapo_temperature_neg", sapo_temperature_neg)):
        if not 0.0 < _float(name, value) < float("inf"):
            raise ValueError(f"{name} must be a finite float > 0{_got(value)}")
    if not 0.0 <= _float("beta", beta) < float("inf"):
        raise ValueError(f"beta must be a finite float >= 0{_got(beta)}")
    if not -float("inf") < _float("entropy_coef", entropy_coef) < float("inf"):
        raise ValueError(f"entropy_coef must be a finite float{_got(entropy_coef)}")
    return PolicyOptions(loss_type, epsilon_low, epsilon_high, delta, sapo_temperature_pos,
                         sapo_temperature_neg, beta, kl, bool(kl_ratio), entropy_coef)


def check_policy_inputs(hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs,
                        token_weights, temperature, loss_type, epsilon_low, epsilon_high,
                        delta, sapo_temperature_pos, sapo_temperature_neg, beta, kl,
                        kl_ratio, entropy_coef, softcap, ignore_index, accumulator):
    """Every check of linear_policy_loss's arguments, in eager mode and in the fake
    kernel (under torch.compile); returns PolicyOptions."""
    opts = check_policy_options(loss_type, epsilon_low, epsilon_high, delta,
                                sapo_temperature_pos, sapo_temperature_neg, beta, kl,
                                kl_ratio, entropy_coef)
    check_logprob_options(softcap, ignore_index, True, accumulator)
    check_inputs(hidden, weight, target, bias, None)
    if hidden.dtype == torch.float16:
        raise TypeError("hidden must be bfloat16, float32 or float64 for linear_policy_loss, "
                        "got torch.float16 (its gradient is formed in the forward, where a "
                        "GradScaler's scale could not keep it from underflowing)")
    if advantages is None:
        raise TypeError("advantages must be a Tensor, got NoneType")
    for name, t in (("advantages", advantages), ("old_logprobs", old_logprobs),
                    ("ref_logprobs", ref_logprobs), ("token_weights", token_weights),
                    ("temperature", temperature)):
        check_per_token(name, t, target)
    if opts.beta != 0.0 and ref_logprobs is None:
        raise ValueError("ref_logprobs must be given when beta != 0 (the KL term's reference)")
    return opts


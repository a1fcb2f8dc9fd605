"""The RL objectives of `python -m torch_fce.bench shapes --objective logprobs|policy`:
each method maps (hidden, weight, target, *data) to a scalar to differentiate.

logprobs: sum of fixed random per-token weights times the log-probs and entropies at
temperature 0.7 (the backward recomputes the logits). policy: the DAPO loss
(token-level clipped ratio, epsilon 0.2 / 0.28, token mean) plus a k3 KL to a reference
at beta 0.04, temperature 0.7, with advantages and old / reference log-probs made once
per shape (policy_data), the advantages per sequence of SEQUENCES sequences (as GRPO's).
Methods: the unfused computation as TRL writes it from logits (eager, compiled), TRL
1.16's fused head (trl.kernels.ChunkedLogProbFunction, as its GRPOTrainer calls it) and,
for policy, Liger's LigerFusedLinearGRPOLoss (at its defaults) where installed, and
torch_fce (with --sweep also at the workspaces of the time-memory sweep; for policy on an
sm_90 GPU with quack-kernels also "fce-exp", the exp-GEMM pipeline, docs/api.md).
"""

import sys

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench.measure import backend, compiled, with_context, with_workspace
from torch_fce.ops.machinery.dispatch import exp_on_cuda

TEMPERATURE = 0.7
EPSILON_LOW, EPSILON_HIGH, BETA = 0.2, 0.28, 0.04
# The same objective as a TRL GRPOConfig's arguments (bench grpo's trainer).
TRL_GRPO_CONFIG = dict(loss_type="dapo", epsilon=EPSILON_LOW, epsilon_high=EPSILON_HIGH,
                       beta=BETA, temperature=TEMPERATURE)
TRL_CHUNK = 32768  # the vocabulary tile GRPOTrainer passes to TRL's head
SEQUENCES = 16  # the policy objective's N tokens are SEQUENCES completions of N / SEQUENCES


def _upstream(t):
    # Deterministic pseudo-random weights in [-1, 1] that torch.compile can trace.
    i = torch.arange(t.shape[0], device=t.device, dtype=torch.float32)
    return torch.sin(i * 12.9898 + 1.0), torch.cos(i * 78.233 + 2.0)


def _unfused_logprobs(h, w, t):
    # As TRL computes them from logits: float32 upcast, divided by the temperature.
    logp = (F.linear(h, w).float() / TEMPERATURE).log_softmax(-1)
    lp = logp.gather(-1, t.clamp_min(0)[:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _weighted(lp, ent, t):
    """The logprobs objective: the fixed upstream weights on log-probs and entropies of
    the tokens not ignored."""
    g, k = _upstream(t)
    valid = t != -100
    return (torch.where(valid, lp, 0.0) * g).sum() + (torch.where(valid, ent, 0.0) * k).sum()


def logprobs_unfused(h, w, t):
    return _weighted(*_unfused_logprobs(h, w, t), t)


def _logprobs_fce(accumulator, logits_dtype=None):
    def run(h, w, t):
        out = torch_fce.linear_logprobs(h, w, t, temperature=TEMPERATURE, entropy=True,
                                        accumulator=accumulator, logits_dtype=logits_dtype)
        return _weighted(out.logprob, out.entropy, t)
    return run


def _sequences(t):
    return SEQUENCES if t.shape[0] % SEQUENCES == 0 else 1


def policy_data(h, w, t):
    """(advantages, old_logprobs, ref_logprobs), each (N,): advantages in [-1, 1], one per
    sequence, the old and reference log-probs the current ones moved by up to 0.3 nats
    (some ratios clip)."""
    with torch.no_grad():
        lp = torch_fce.linear_logprobs(h, w, t, temperature=TEMPERATURE).logprob
    g, k = _upstream(t)
    B = _sequences(t)
    advantages = g[:B].repeat_interleave(t.shape[0] // B)
    return advantages, lp + 0.3 * k, lp - 0.3 * g * k


def _dapo_k3(lp, t, advantages, old, ref):
    """TRL's GRPOTrainer loss for loss_type="dapo", token-level importance sampling,
    beta > 0: the clipped ratio plus beta * k3, summed over counted tokens / their count."""
    r = torch.exp(lp - old)
    clipped = torch.clamp(r, 1 - EPSILON_LOW, 1 + EPSILON_HIGH)
    per = -torch.min(r * advantages, clipped * advantages)
    d = ref - lp
    per = per + BETA * (torch.exp(d) - d - 1)
    mask = (t != -100).float()
    return (per * mask).sum() / mask.sum().clamp(min=1.0)


def policy_unfused(h, w, t, advantages, old, ref):
    return _dapo_k3(_unfused_logprobs(h, w, t)[0], t, advantages, old, ref)


def _policy_fce(accumulator, logits_dtype=None):
    def run(h, w, t, advantages, old, ref):
        return torch_fce.linear_policy_loss(
            h, w, t, advantages, old_logprobs=old, ref_logprobs=ref, loss_type="clip",
            epsilon_low=EPSILON_LOW, epsilon_high=EPSILON_HIGH, beta=BETA, kl="k3",
            temperature=TEMPERATURE, accumulator=accumulator, logits_dtype=logits_dtype)[0]
    return run


def _trl_head():
    """(hidden, weight, target) -> (logprobs, entropies) through TRL's fused head."""
    from trl.kernels import ChunkedLogProbFunction

    def head(h, w, t):
        lp, ent, *_ = ChunkedLogProbFunction.apply(h, w, None, t.clamp_min(0), TEMPERATURE,
                                                   TRL_CHUNK, None, 1.0, ("entropy",))
        valid = t != -100
        return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)
    return head


def _trl(objective):
    head = _trl_head()
    if objective == "logprobs":
        return lambda h, w, t: _weighted(*head(h, w, t), t)
    return lambda h, w, t, *data: _dapo_k3(head(h, w, t)[0], t, *data)


def _liger():
    """The policy objective through Liger's fused GRPO loss (its defaults: chunks of one
    sequence, compiled), on the same tokens as SEQUENCES sequences."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_low=EPSILON_LOW,
                                    epsilon_high=EPSILON_HIGH, loss_type="dapo",
                                    temperature=TEMPERATURE)

    def run(h, w, t, advantages, old, ref):
        B = _sequences(t)
        T = t.shape[0] // B
        return loss(h.reshape(B, T, -1), w, t.clamp_min(0).reshape(B, T),
                    (t != -100).long().reshape(B, T), advantages[::T],
                    ref_per_token_logps=ref.reshape(B, T),
                    old_per_token_logps=old.reshape(B, T))[0]
    return run


def methods(objective, device, with_compile, sweep=()):
    """Name -> function for --objective logprobs or policy: unfused (eager, compiled),
    TRL's fused head and Liger's GRPO loss (CUDA, where installed), torch_fce, and with
    sweep (workspaces in MiB) torch_fce fp32 at each ("fce-fp32@MiB")."""
    unfused = logprobs_unfused if objective == "logprobs" else policy_unfused
    out = {"torch": unfused}
    if with_compile:
        out.update(compiled(unfused))
    if device == "cuda":
        peers = {"trl-head": lambda: _trl(objective)}
        if objective == "policy":
            peers["liger-grpo"] = _liger
        for name, make in peers.items():
            try:
                out[name] = make()
            except Exception as e:  # missing, or installed without what it imports
                print(f"  {name} unavailable: {type(e).__name__}: {e}"[:200],
                      file=sys.stderr)
    fce = _logprobs_fce if objective == "logprobs" else _policy_fce
    for acc in ("fp32", "input"):
        out[f"fce-{acc}"] = fce(acc)
    out["fce-f32logits"] = fce("fp32", torch.float32)
    if objective == "policy" and device == "cuda" and exp_on_cuda(torch.cuda.current_device()):
        out["fce-exp"] = with_context(fce("fp32"), lambda: backend("exp"))
    for mib in sweep:
        out[f"fce-fp32@{mib}"] = with_workspace(fce("fp32"), mib)
    return out

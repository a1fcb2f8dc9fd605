"""The policy loss's room: fce::linear_policy_loss, whole.

Its options (PolicyOptions), each loss type's per-token formula, the schemas, the
public op's entry, the fake kernel, the autograd formula and the implementation on the
chunk loop (one device or a vocabulary shard).

The loss is sum_t w_t * (policy_t + beta * kl_t - entropy_coef * entropy_t) over the
tokens not ignored, with r_t = exp(logprob_t - old_t) (1 without old log-probs, with
the derivative of exp(logprob - logprob.detach())), A_t the advantage, policy_t the
loss type's formula (LOSS_TYPES below: TRL 1.16's GRPOTrainer's at token-level
importance sampling) and kl_t the KL estimator's (KL_ESTIMATORS), times r with kl_ratio
(TRL's use_bias_correction_kl; r differentiated as above; with beta 0 a statistic only).
The loss is a scalar, so the forward forms the gradients (3 GEMMs): per chunk the row
function forms the log-probs and entropies, `_terms` each token's loss term, autograd on
those (n,) vectors its derivatives g_lp, g_h with torch's own tie rules (min splits a
tie's gradient in halves, clamp passes it at its bounds), and the row function the
logits gradient dz = g_lp * dlogprob/dz + g_h * dentropy/dz from the same chunk. A new
loss type is a new entry of LOSS_TYPES: no calculus by hand.
"""

import collections
from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, forward_needs_grad, int64_if_needed,
                             refuse_transforms, token_rows)
from ..contract.options import as_float, check_choice, got, take, tensor_record
from ..loop import exp_gemms
from ..loop.chunked import (ONE_DEVICE, VocabShard, after_first_gemm, chunk_rows_for,
                           grad_outputs, inverse_temperature, logits_dtype_for,
                           math_dtype_for, no_autocast, run_chunks)
from ..loop.tokens import token_weights
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from ..linear_logprobs import logprob_rows, truncation, truncation_rows
from ..linear_logprobs.rows import shard_stats
from . import exp_rows


class PolicyOptions(NamedTuple):
    """linear_policy_loss' options (docs/rl.md), in the schemas' order."""
    loss_type: str = "clip"
    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None  # None: epsilon_low
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    beta: float = 0.0
    kl: str = "k3"
    kl_ratio: bool = False
    entropy_coef: float = 0.0
    softcap: Optional[float] = None
    ignore_index: int = -100
    accumulator: str = "fp32"
    logits_dtype: Optional[torch.dtype] = None  # torch.float32: the GEMM's float32 sums
    # the sampler's truncation (linear_logprobs/truncation.py): its distribution's log-probs
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    def check(self):
        """Raises naming the option; returns the record with epsilon_high resolved."""
        check_choice("loss_type", self.loss_type, tuple(LOSS_TYPES))
        checks.check_truncation(self)
        check_choice("kl", self.kl, tuple(KL_ESTIMATORS))
        checks.check_common(self)
        if not 0.0 <= as_float("epsilon_low", self.epsilon_low) < float("inf"):
            raise ValueError(f"epsilon_low must be a finite float >= 0{got(self.epsilon_low)}")
        high = self.epsilon_low if self.epsilon_high is None else self.epsilon_high
        if not 0.0 <= as_float("epsilon_high", high) < float("inf"):
            raise ValueError(f"epsilon_high must be None or a finite float >= 0{got(high)}")
        if self.delta is not None and not 0.0 < as_float("delta", self.delta) < float("inf"):
            raise ValueError(f"delta must be None or a finite float > 0{got(self.delta)}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not 0.0 < as_float(name, getattr(self, name)) < float("inf"):
                raise ValueError(f"{name} must be a finite float > 0{got(getattr(self, name))}")
        if not 0.0 <= as_float("beta", self.beta) < float("inf"):
            raise ValueError(f"beta must be a finite float >= 0{got(self.beta)}")
        if not -float("inf") < as_float("entropy_coef", self.entropy_coef) < float("inf"):
            raise ValueError(f"entropy_coef must be a finite float{got(self.entropy_coef)}")
        return self._replace(epsilon_high=high, kl_ratio=bool(self.kl_ratio))


# ---- the per-token math: one entry per loss type and KL estimator ----------------
# Each loss type: (term, clipped) of each token from its log-prob lp (differentiable),
# ratio r, advantage A and the options; docs/rl.md's table is written from the formulas.

def _clip(lp, r, A, opts):
    """-min(min(r, delta) A, clamp(r, 1 - eps_low, 1 + eps_high) A): PPO / GRPO / DAPO /
    Dr.GRPO / BNPO"""
    low, high = 1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high
    c1 = r if opts.delta is None else torch.clamp(r, max=opts.delta)
    clipped = ((c1 < low) & (A < 0)) | ((c1 > high) & (A > 0))
    return -torch.minimum(c1 * A, torch.clamp(r, low, high) * A), clipped


def _cispo(lp, r, A, opts):
    """-min(r, eps_high).detach() A lp: the clipped ratio as a constant weight"""
    clipped = (r > opts.epsilon_high) & (A > 0)  # TRL's cispo_clip_ratio
    return -torch.clamp(r, max=opts.epsilon_high).detach() * A * lp, clipped


def _sapo(lp, r, A, opts):
    """-sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos if A > 0 else _neg"""
    # fills, not host-to-device copies (which a CUDA graph capture refuses)
    tau = torch.where(A > 0, torch.full_like(A, opts.sapo_temperature_pos),
                      torch.full_like(A, opts.sapo_temperature_neg))
    return -torch.sigmoid(tau * (r - 1.0)) * 4.0 / tau * A, torch.zeros_like(A, dtype=torch.bool)


def _reinforce(lp, r, A, opts):
    """-r A"""
    return -r * A, torch.zeros_like(A, dtype=torch.bool)


LOSS_TYPES = {"clip": _clip, "cispo": _cispo, "sapo": _sapo, "reinforce": _reinforce}

# Each KL estimator of d = logprob - ref.
KL_ESTIMATORS = {
    "k1": lambda d: d,                           # d
    "k2": lambda d: 0.5 * d * d,                 # d^2 / 2
    "k3": lambda d: torch.exp(-d) + d - 1.0,     # exp(-d) + d - 1
}


def _policy_term(lp, A, old, opts):
    """(term, ratio, clipped) of each token, differentiable in lp. Without old log-probs
    the ratio is 1 (its derivative lp's), also at a log-prob of -inf (a truncation's
    target outside its kept set: no gradient there)."""
    if old is None:
        lp0 = torch.where(lp > float("-inf"), lp, 0.0)
        r = torch.exp(lp0 - lp0.detach())
    else:
        r = torch.exp(lp - old)
    return (*LOSS_TYPES[opts.loss_type](lp, r, A, opts), r)


def _kl(lp, ref, r, opts):
    kl = KL_ESTIMATORS[opts.kl](lp - ref)
    return r * kl if opts.kl_ratio else kl


class _Terms(NamedTuple):
    """A chunk's per-token results, each (n,): the weighted loss term, its derivatives
    w.r.t. the token's log-prob and entropy (g_h None without an entropy term), the
    ratio, the clip indicator and the KL, 0 at ignored tokens."""
    loss: torch.Tensor
    g_lp: torch.Tensor
    g_h: Optional[torch.Tensor]
    ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


# The op's per-token outputs, in the order run_chunks writes them.
_Outputs = collections.namedtuple("_Outputs", "loss logprob entropy ratio clipped kl")


def _terms(logprob, entropy, chunk, valid, advantages, old, ref, weights, opts):
    """The _Terms of a chunk's tokens: logprob, entropy (n,) theirs, chunk the slice of
    the (N,) tensors valid ... weights (old, ref may be None) that is theirs. Autograd
    differentiates the formula on these (n,) vectors below the op's own autograd
    (inference_mode(False) lifts the dispatcher's exclusion of the autograd keys; the
    tensors entering that small graph are cloned, so none is an inference tensor). The
    formula is elementwise: the gradient of the sum is each token's derivative."""
    mdt = logprob.dtype
    valid, advantages, weights = valid[chunk], advantages[chunk], weights[chunk]
    old, ref = (None if a is None else a[chunk] for a in (old, ref))
    with torch.inference_mode(False), torch.enable_grad():
        # ignored tokens: no NaN from their logits
        lp = torch.where(valid, logprob, 0.0).clone().requires_grad_()
        ent = entropy.clone().requires_grad_() if opts.entropy_coef != 0.0 else None
        A = advantages.to(mdt).clone()
        w = torch.where(valid, weights.to(mdt), 0.0).clone()
        term, clipped, r = _policy_term(lp, A, None if old is None else old.to(mdt).clone(),
                                        opts)
        kl = _kl(lp, ref.to(mdt).clone(), r, opts) if ref is not None else None
        if kl is not None and opts.beta != 0.0:  # beta 0: a statistic (no 0 * inf)
            term = term + opts.beta * kl
        if ent is not None:
            term = term - opts.entropy_coef * ent
        loss_t = w * term
        g_lp, g_h = torch.autograd.grad(loss_t.sum(), (lp, ent) if ent is not None else (lp,),
                                        allow_unused=True) + ((None,) if ent is None else ())
    zero = torch.zeros_like(logprob)
    return _Terms(loss=torch.where(valid, loss_t.detach(), zero),
                  g_lp=torch.where(valid, g_lp, zero), g_h=g_h,
                  ratio=torch.where(valid, r.detach(), zero),
                  clipped=(clipped & valid).to(mdt),
                  kl=zero if kl is None else torch.where(valid, kl.detach(), zero))


# ---- schemas and the public op -----------------------------------------------------

# linear_policy_loss' optional per-token tensors, each None or target's shape (not
# differentiated)
PolicyTensors = tensor_record("PolicyTensors", "old_logprobs", "ref_logprobs",
                              "token_weights", "temperature")


# The internal op takes hidden (N, D), the per-token tensors (N,). The loss is a scalar,
# so its forward forms the gradients for a unit upstream gradient (3 GEMMs).
grads.define_forward_grads_ops(
    "linear_policy_loss",
    ("Tensor hidden", "Tensor weight", "Tensor target", "Tensor advantages", "Tensor? bias"),
    PolicyTensors, PolicyOptions, ("logprob", "entropy", "ratio", "clipped", "kl"))


def check_policy_inputs(hidden, weight, target, advantages, bias, tensors, opts):
    """The tensors' checks (tensors: a PolicyTensors), in eager mode and in the fake
    kernel (under torch.compile)."""
    checks.check_head_inputs(hidden, weight, target, bias, None)
    if advantages is None:
        raise TypeError("advantages must be a Tensor, got NoneType")
    for name, t in (("advantages", advantages), *tensors._asdict().items()):
        checks.check_per_token(name, t, target)
    if opts.beta != 0.0 and tensors.ref_logprobs is None:
        raise ValueError("ref_logprobs must be given when beta != 0 (the KL term's reference)")


def forward(hidden, weight, target, advantages, bias, tensors, opts, shard=ONE_DEVICE):
    """(loss, logprob, entropy, ratio, clipped, kl) for checked options and a
    PolicyTensors; also the vocab-parallel entry."""
    refuse_transforms((hidden, weight, bias, advantages, *tensors))
    hidden, weight, bias = autocast_operands(hidden, weight, bias)  # dtypes checked after
    check_policy_inputs(hidden, weight, target, advantages, bias, tensors, opts)
    target = int64_if_needed(target, opts.ignore_index)
    loss, _, _, _, *stats = torch.ops.fce.linear_policy_loss_fwd(
        token_rows(hidden), weight, flat(target), flat(advantages), bias,
        *(flat(t) for t in tensors), *opts, *shard, forward_needs_grad(hidden, weight, bias))
    return (loss, *(t.reshape(target.shape) for t in stats))


@torch.library.impl(LIB, "linear_policy_loss", "CompositeImplicitAutograd")
def _linear_policy_loss(hidden, weight, target, advantages, bias=None, old_logprobs=None,
                        ref_logprobs=None, token_weights=None, temperature=None, **options):
    return forward(hidden, weight, target, advantages, bias,
                   PolicyTensors(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                 token_weights=token_weights, temperature=temperature),
                   PolicyOptions(**options).check())


@torch.library.register_fake("fce::linear_policy_loss_fwd")
def _fwd_fake(hidden, weight, target, advantages, bias, *args):
    tensors, args = take(PolicyTensors, args)
    opts, rest = take(PolicyOptions, args)
    opts = opts.check()
    check_policy_inputs(hidden, weight, target, advantages, bias, tensors, opts)
    shard, (needs,) = take(VocabShard, rest)
    return grads.fake_forward_grads_outputs(hidden, weight, bias, needs, opts, shard, 5)


# ---- autograd: the forward's gradients scaled by the upstream gradient -------------

def _counted(args):
    """The tokens counted, from linear_policy_loss_fwd's arguments (by name)."""
    return args["target"] != args["ignore_index"]


grads.register_forward_grads_autograd("linear_policy_loss_fwd", _counted)


# ---- the implementation, on the chunk loop -----------------------------------------

@kernel("linear_policy_loss_fwd")
def fwd(hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs,
         token_weights_, temperature, *args, backend):
    """(loss, grad_hidden, grad_weight, grad_bias, logprob, entropy, ratio, clipped, kl):
    per chunk the row function's statistics (global across a shard group), `_terms`
    their loss terms and upstream gradients, and the row function's dz from the same
    chunk."""
    opts, rest = take(PolicyOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    truncated = truncation_rows(backend, opts, shard, shard.vocab(weight))
    rows = logprob_rows(backend)
    if backend.check_values:
        checks.check_target_range(target, shard.vocab(weight), opts.ignore_index)
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    out = _Outputs(*(hidden.new_empty(N, dtype=mdt) for _ in _Outputs._fields))
    want = any(needs)
    if backend.exp and shard.group is None and exp_rows.serves(hidden, weight, bias, opts):
        gradients = _exp_chunks(hidden, weight, target, advantages, old_logprobs,
                                ref_logprobs, token_weights_, temperature, opts, needs, out,
                                backend)
        loss_t, *stats = out
        return (loss_t.sum(), *grad_outputs(hidden, weight, bias, gradients, True), *stats)

    @after_first_gemm
    def per_token():  # 1 / T, whether counted, w_t
        valid = target != opts.ignore_index
        return (inverse_temperature(temperature, N, hidden.device, mdt), valid,
                token_weights(token_weights_, valid, mdt))

    def row_fn(logits, s, e):
        inv_t, valid, weights = per_token()
        terms = []

        def upstream(logprob, entropy):
            terms.append(_terms(logprob, entropy, slice(s, e), valid, advantages,
                                old_logprobs, ref_logprobs, weights, opts))
            return terms[0].g_lp, terms[0].g_h

        if truncated is not None:  # the sampler's distribution
            lp, ent, _, _, row_stats = truncation.kept_stats(
                truncated, logits, target[s:e], inv_t[s:e], opts, mdt, shard)
            g_lp, g_h = upstream(lp, ent)
            dz = truncated.grad(logits, target[s:e], inv_t[s:e], opts, g_lp, g_h, row_stats,
                                mdt, shard.vocab_start, hidden.dtype) if want else None
        elif want:
            lp, ent, *_, dz = rows.stats_then_grad(
                logits, target[s:e], inv_t[s:e], opts, upstream, mdt, shard, hidden.dtype)
        else:
            lp, ent, *_ = shard_stats(rows, logits, target[s:e], inv_t[s:e], opts, True,
                                      mdt, shard)
            upstream(lp, ent)
            dz = None
        t, = terms
        return _Outputs(t.loss, lp, ent, t.ratio, t.clipped, t.kl), dz

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)
        gradients = run_chunks(hidden, weight, bias, row_fn, out, needs, opts.accumulator,
                               chunk_rows_for(hidden, weight, shard, ldt,
                                              log_prob_tiles=False,
                                              per_logit=truncation.per_logit(
                                                  truncated, ldt, hidden.dtype, opts,
                                                  shard.vocab(weight), shard)), shard=shard,
                               logits_dtype=ldt, triton=backend.sums)
    loss_t, *stats = out
    return (loss_t.sum(), *grad_outputs(hidden, weight, bias, gradients,
                                        opts.accumulator == "fp32", shard.group is not None),
            *stats)



def _exp_chunks(hidden, weight, target, advantages, old_logprobs, ref_logprobs,
                token_weights_, temperature, opts, needs, out, backend):
    """The chunks on the exp-GEMM pipeline (loop/exp_gemms.py, exp_rows.py; on the
    Triton rows their twin, exp_kernels.py): each chunk's log-probs and entropies from
    the tempered logits GEMM's partials, `_terms` their loss terms and derivatives, the
    gradient GEMMs the rest; out (an _Outputs of (N,) float32) is written. Returns the
    gradients."""
    N, V, f32 = hidden.shape[0], weight.shape[0], torch.float32
    valid = target != opts.ignore_index
    inv_t = inverse_temperature(temperature, N, hidden.device, f32)
    weights = token_weights(token_weights_, valid, f32)
    want = any(needs)
    rows_of = exp_rows.policy_exp_rows
    if backend.triton:
        from .exp_kernels import triton_policy_exp_rows as rows_of

    def row_fn(tile, s, e, m, zsum):
        terms = []

        def upstream(logprob, entropy):
            terms.append(_terms(logprob, entropy, slice(s, e), valid, advantages,
                                old_logprobs, ref_logprobs, weights, opts))
            return terms[0].g_lp if want else None

        lp, ent, g = rows_of(tile, target[s:e], valid[s:e], inv_t[s:e], V, upstream)
        t, = terms
        return _Outputs(t.loss, lp, ent, t.ratio, t.clipped, t.kl), g

    rows = chunk_rows_for(hidden, weight, logits_dtype=hidden.dtype,
                          per_logit=exp_rows.BYTES_PER_LOGIT, log_prob_tiles=False)
    with no_autocast(hidden):
        return exp_gemms.run_exp_chunks(hidden, weight, row_fn, out, needs, rows,
                                        torch.where(valid, target, -1).long(), valid,
                                        triton=backend.sums, inv_t=inv_t)

"""The sparse divergence's room: fce::linear_sparse_divergence, whole.

Its options (SparseDivOptions), the per-token formula, the schemas, the public op's
entry, the fake kernel, the autograd formula and the implementation on the chunk loop.

A student trained on a teacher's top-k (on-policy distillation from a server's or an
in-process teacher's linear_topk_logprobs). Per token, with S the support's valid
entries (an index equal to ignore_index, or a teacher log-prob of -inf, is not valid; a
token without valid entries is not counted) and s_j the student's full-vocabulary
log-softmax of softcap(logit_scale * logits) / T at class j, both distributions are
made proper over the support, as TRL 1.16's server and async distillation trainers do:
  tail=True:  a (K+1)-th bucket log(1 - sum_S exp(.)) for each (TRL's _add_tail_bucket,
              its clamp of the sum below 1 included)
  tail=False: each renormalised over S (minus its logsumexp over S)
then TRL's generalized JSD over that support (_jsd_divergence: beta 0 KL(teacher ||
student), 1 KL(student || teacher), between the mixture form). loss = sum_t w_t
div_t. The formula is written once, on the (n, K) log-probs (`_divergence`); autograd
gives its derivative g w.r.t. the student's support log-probs, and the row math
(rowmath/distill.sparse_rows and its Triton twin, the sparse-target cross entropy's
too) forms the logits gradient from g in the same pass: three GEMMs, the gradients
formed in the forward. Beside the divergence and the student's mass on the support, the
rows give the student's whole-distribution entropy (TRL's async trainer logs it).
"""

import collections
import math
from typing import NamedTuple, Optional

import torch

from .contract import checks
from .contract.entry import (autocast_operands, flat, forward_needs_grad, refuse_transforms,
                             token_rows)
from .contract.options import as_float, check_bool, got, take, tensor_record
from .loop.chunked import (ONE_DEVICE, VocabShard, after_first_gemm, chunk_rows_for,
                           grad_outputs, inverse_temperature, logits_dtype_for,
                           math_dtype_for, no_autocast, run_chunks)
from .loop.tokens import token_weights
from .machinery import grads
from .machinery.dispatch import LIB, kernel

class SparseDivOptions(NamedTuple):
    """linear_sparse_divergence's options (docs/distillation.md), in the schemas' order."""
    beta: float = 0.0
    tail: bool = False
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    ignore_index: int = -100
    accumulator: str = "fp32"
    logits_dtype: Optional[torch.dtype] = None  # torch.float32: the GEMM's float32 sums

    def check(self):
        """Raises naming the option; returns the record."""
        checks.check_common(self)
        if not 0.0 <= as_float("beta", self.beta) <= 1.0:
            raise ValueError(f"beta must be a float in [0, 1]{got(self.beta)}")
        check_bool("tail", self.tail)
        if not 0.0 < as_float("logit_scale", self.logit_scale) < float("inf"):
            raise ValueError(f"logit_scale must be a finite float > 0{got(self.logit_scale)}")
        return self


# linear_sparse_divergence's optional tensors (token_weights and temperature: the
# tokens' shape)
SparseDivTensors = tensor_record("SparseDivTensors", "bias", "token_weights", "temperature")


# ---- the per-token math: TRL 1.16's, on the support's log-probs --------------------

def _with_tail(lp, entries):
    """TRL's _add_tail_bucket: (K+1) log-probs, the last log(1 - sum exp(lp)), the sum's
    log clamped below -1e-7 (so the bucket stays finite), and its support mask."""
    log_sum = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return (torch.cat([lp, tail], dim=-1),
            torch.cat([entries, torch.ones_like(entries[..., :1])], dim=-1))


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


def _divergence(s, t, entries, opts):
    """Each token's divergence (n,) from the student's and the teacher's log-probs at
    the support (n, K), only valid entries read (every token has one)."""
    neg_inf = torch.full((), -math.inf, dtype=s.dtype, device=s.device)
    s, t = torch.where(entries, s, neg_inf), torch.where(entries, t, neg_inf)
    if opts.tail:
        (s, support), (t, _) = _with_tail(s, entries), _with_tail(t, entries)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
        support = entries
    return _jsd(s, t, opts.beta, support).sum(-1)


class _Terms(NamedTuple):
    """A chunk's per-token results, each (n,) but g (n, K): the weighted loss term, its
    derivative w.r.t. the student's support log-probs, the divergence and the student's
    mass on the support, 0 at tokens not counted."""
    loss: torch.Tensor
    g: torch.Tensor
    divergence: torch.Tensor
    mass: torch.Tensor


def _terms(log_q, teacher, entries, weights, opts):
    """The _Terms of a chunk: autograd differentiates `_divergence` on these (n, K)
    tensors below the op's own autograd (inference_mode(False) lifts the dispatcher's
    exclusion of the autograd keys; the tensors entering the small graph are cloned)."""
    counted = entries.any(-1)
    # a token without valid entries reads one dummy entry (its results are zeroed)
    first = torch.zeros_like(entries)
    first[:, :1] = True
    safe = torch.where(counted[:, None], entries, first)
    mdt = log_q.dtype
    with torch.inference_mode(False), torch.enable_grad():
        s = log_q.clone().requires_grad_()
        t = torch.where(safe & ~entries, 0.0, teacher.to(mdt)).clone()
        div = _divergence(s, t, safe, opts)
        w = torch.where(counted, weights.to(mdt), 0.0).clone()
        loss_t = w * torch.where(counted, div, 0.0)
        g, = torch.autograd.grad(loss_t.sum(), s)
    zero = torch.zeros_like(w)
    mass = torch.where(entries, log_q.exp(), 0.0).sum(-1)
    return _Terms(loss_t.detach(), torch.where(entries, g, 0.0),
                  torch.where(counted, div.detach(), zero), torch.where(counted, mass, zero))


# ---- schemas and the public op -----------------------------------------------------

# The internal op takes hidden (N, D), support and teacher_logprobs (N, K), the
# per-token tensors (N,), a VocabShard (weight and bias then this rank's classes).
grads.define_forward_grads_ops(
    "linear_sparse_divergence",
    ("Tensor hidden", "Tensor weight", "Tensor support", "Tensor teacher_logprobs"),
    SparseDivTensors, SparseDivOptions, ("divergence", "student_mass", "entropy"))


def check_sparse_div_inputs(hidden, weight, support, teacher, tensors):
    """The tensors' checks, in eager mode and in the fake kernel (under torch.compile)."""
    if not isinstance(support, torch.Tensor):
        raise TypeError(f"support must be a Tensor, got {type(support).__name__}")
    if support.dtype not in checks.TARGET_DTYPES:
        raise TypeError(f"support must be int64 or int32 class indices, got {support.dtype}")
    if support.dim() < 1 or support.dim() != hidden.dim():
        raise ValueError(f"support must have shape (*, K) with * hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(support.shape)}")
    tokens = support[..., 0]  # a view of the tokens' shape for the shared checks
    checks.check_head_inputs(hidden, weight, tokens, tensors.bias, None)
    # a teacher's, not differentiated, of support's shape
    checks.check_per_token("teacher_logprobs", teacher, support, like="support")
    checks.check_per_token("token_weights", tensors.token_weights, tokens)
    checks.check_temperature(tensors.temperature, tokens)


def forward(hidden, weight, support, teacher, tensors, opts, shard=ONE_DEVICE):
    """(loss, divergence, student_mass, entropy) for checked options and a
    SparseDivTensors; also the vocab-parallel entry (weight and bias then this rank's
    classes)."""
    refuse_transforms((hidden, weight, tensors.bias))
    hidden, weight, bias = autocast_operands(hidden, weight, tensors.bias)
    tensors = tensors._replace(bias=bias)  # dtypes checked after autocast
    check_sparse_div_inputs(hidden, weight, support, teacher, tensors)
    K, shape = support.shape[-1], hidden.shape[:-1]
    loss, _, _, _, *stats = torch.ops.fce.linear_sparse_divergence_fwd(
        token_rows(hidden), weight, support.reshape(-1, K), teacher.detach().reshape(-1, K),
        bias, flat(tensors.token_weights), flat(tensors.temperature), *opts, *shard,
        forward_needs_grad(hidden, weight, bias))
    return (loss, *(s.reshape(shape) for s in stats))


@torch.library.impl(LIB, "linear_sparse_divergence", "CompositeImplicitAutograd")
def _linear_sparse_divergence(hidden, weight, support, teacher_logprobs, bias=None,
                              token_weights=None, temperature=None, **options):
    return forward(hidden, weight, support, teacher_logprobs,
                   SparseDivTensors(bias=bias, token_weights=token_weights,
                                    temperature=temperature),
                   SparseDivOptions(**options).check())


@torch.library.register_fake("fce::linear_sparse_divergence_fwd")
def _fwd_fake(hidden, weight, support, teacher, *args):
    tensors, args = take(SparseDivTensors, args)
    opts, rest = take(SparseDivOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    check_sparse_div_inputs(hidden, weight, support, teacher, tensors)
    return grads.fake_forward_grads_outputs(hidden, weight, tensors.bias, needs, opts, shard,
                                            len(_Outputs._fields) - 1)


# ---- autograd: the forward's gradients scaled by the upstream gradient -------------

def _valid_entries(support, teacher, ignore_index):
    """The support's valid entries: not ignore_index, a finite teacher log-prob."""
    return (support != ignore_index) & (teacher > -math.inf)


def _counted(args):
    """The tokens counted, from linear_sparse_divergence_fwd's arguments."""
    ignore_index = take(SparseDivOptions, args[7:])[0].ignore_index
    return _valid_entries(args[2], args[3], ignore_index).any(-1)


# hidden, weight and bias among linear_sparse_divergence_fwd's arguments; token_weights
grads.register_forward_grads_autograd("linear_sparse_divergence_fwd", (0, 1, 4),
                                      weights=(5, _counted))


# ---- the implementation, on the chunk loop -----------------------------------------

# The op's per-token outputs, in the order run_chunks writes them.
_Outputs = collections.namedtuple("_Outputs", "loss divergence student_mass entropy")


@kernel("linear_sparse_divergence_fwd")
def fwd(hidden, weight, support, teacher, bias, token_weights_, temperature, *args, backend):
    """(loss, grad_hidden, grad_weight, grad_bias, divergence, student_mass, entropy):
    per chunk the logits, then the backend's sparse rows with this op's terms (a
    VocabShard: the PyTorch rows, their row sums all-reduced)."""
    opts, rest = take(SparseDivOptions, args)
    opts = opts.check()
    shard, (needs,) = take(VocabShard, rest)
    V = shard.vocab(weight)
    if backend.check_values:
        checks.check_target_range(support, V, opts.ignore_index, "support")
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    sparse = backend.distill.sparse_for(shard)
    out = _Outputs(*(hidden.new_empty(N, dtype=mdt) for _ in _Outputs._fields))

    @after_first_gemm
    def per_token():  # 1 / T, w_t, the valid entries, the out-of-range ones, safe classes
        entries = _valid_entries(support, teacher, opts.ignore_index)
        # out-of-range classes read column 0, their token's loss NaN (as the other ops)
        bad = entries & ((support < 0) | (support >= V))
        return (inverse_temperature(temperature, N, hidden.device, mdt),
                token_weights(token_weights_, entries.any(-1), mdt), entries, bad,
                torch.where(entries & ~bad, support, 0).long())

    def row_fn(logits, s, e):
        inv_t, weights, entries, bad, safe = per_token()

        def terms(log_q):
            log_q = torch.where(bad[s:e], math.nan, log_q)
            t = _terms(log_q, teacher[s:e], entries[s:e], weights[s:e], opts)
            return t.loss, t.g, t.divergence, t.mass

        (loss_t, div, mass, ent), dz = sparse.rows(
            logits, safe[s:e], inv_t[s:e], terms, mdt, hidden.dtype, any(needs),
            opts.logit_scale, opts.softcap, entropy=True, shard=shard)
        # a token not counted: g = 0, so dz is exactly 0 (the sparse rows see to it)
        return _Outputs(loss_t, div, mass, torch.where(entries[s:e].any(-1), ent, 0.0)), dz

    with no_autocast(hidden):
        ldt = logits_dtype_for(hidden, opts)
        per_logit = sparse.per_logit(ldt, hidden.dtype)
        gradients = run_chunks(hidden, weight, bias, row_fn, out, needs, opts.accumulator,
                               chunk_rows_for(hidden, weight, shard, per_logit=per_logit),
                               shard=shard, logits_dtype=ldt)
    return (out.loss.sum(), *grad_outputs(hidden, weight, bias, gradients,
                                          opts.accumulator == "fp32", shard.group is not None),
            out.divergence, out.student_mass, out.entropy)

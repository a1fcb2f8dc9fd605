"""Vocab-parallel linear cross-entropy: the lm head's rows are split across a group.

Each rank holds rows [vocab_start, vocab_start + Vs) of the (V, D) head (Megatron's
column-parallel lm head) and the full hidden states and targets. Per token chunk a rank
forms its shard's logits and reduces them to O(n) vectors (the shard's logsumexp, the
target logit, the weighted logit sum); two all-reduces (a max, then one stacked sum)
give every rank the chunk's global logsumexp and loss terms. For scalar losses the
chunk's logits gradient follows at once (gradients formed in the forward, 3 GEMMs, as
the single-device op does); otherwise the backward recomputes the logits. dz uses the
global lse and the same coefficients as one device (ops/rows.grad_coefficients); dW
and db stay local and the hidden gradient's float32 partial sums are all-reduced once.
On CUDA the row work is the Triton row kernel's two sweeps as separate kernels;
elsewhere their PyTorch twins. Collectives are functional
(torch.distributed._functional_collectives) so torch.compile traces them.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..ops import checks, policy
from ..ops.accumulate import GradAccumulator, _mm_f32
from ..ops.checks import (check_inputs, check_logprob_options, check_options,
                          check_temperature)
from ..ops.chunked import inverse_temperature, math_dtype_for
from ..ops.logprob_rows import rebased_ez
from ..ops.rows import (RowOptions, first_max, grad_coefficients, softcapped,
                        torch_shard_grad, torch_shard_stats)
from ..ops.tokens import (advantages_tensor, counted_target_weights, grad_scales, reduce_loss,
                         temperature_tensor)
from ..ops.workspace import chunk_rows
from ..results import LogProbs, PolicyStats

try:  # the same condition as the op's CUDA backend (ops/__init__.py)
    from ..ops.triton.rows import triton_shard_grad, triton_shard_stats
except ImportError:
    triton_shard_grad = triton_shard_stats = None


def _row_math(hidden, V, group):
    """(stats, grad, token chunks) for this device: the Triton sweeps and the CUDA
    workspace on CUDA, the PyTorch twins and the CPU workspace elsewhere.

    Every rank must cut the same chunks (each chunk's statistics are all-reduced), so the
    size comes from V / world size, not from this rank's shard: with uneven shards a
    larger shard's chunk exceeds the workspace by its share over V / world size."""
    N, D = hidden.shape
    Vs = -(-V // dist.get_world_size(group))
    rows = chunk_rows(N, max(1, Vs), D, hidden.dtype, hidden.device)
    if hidden.is_cuda and hidden.dtype != torch.float64 and triton_shard_stats is not None:
        stats, grad = triton_shard_stats, triton_shard_grad
    else:
        stats, grad = torch_shard_stats, torch_shard_grad
    return stats, grad, [(s, min(N, s + rows)) for s in range(0, N, rows)]


def _shard(hidden, weight, bias, target, class_weight, start, V, opts):
    """What forward and backward both derive: the head in hidden's dtype, the shard's
    class weights, the sum W of all class weights, and each target's column in the
    shard (-1 where it lives elsewhere or is ignored)."""
    Vs = weight.shape[0]
    w, b = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    cw = None if class_weight is None else class_weight[start:start + Vs]
    W = float(V) if class_weight is None else class_weight.to(
        math_dtype_for(hidden.dtype)).sum()
    here = (target >= start) & (target < start + Vs) & (target != opts.ignore_index)
    return w, b, cw, W, torch.where(here, target - start, -1).int()


class _ShardGrads:
    """The hidden gradient's float32 partial sums (all-reduced once, at the end) and
    the local shard's weight and bias gradients, those flagged in `needs`."""

    def __init__(self, hidden, weight, accumulator, needs, mdt):
        self.mdt = mdt
        self.gh = hidden.new_empty(hidden.shape, dtype=mdt) if needs[0] else None
        self.gw = GradAccumulator(accumulator, weight.shape, hidden.dtype, weight.dtype,
                                  hidden.device) if needs[1] else None
        self.gb = hidden.new_zeros(weight.shape[0], dtype=mdt) if needs[2] else None

    def add(self, a, e, dz, hidden, w):
        if self.gh is not None:
            self.gh[a:e] = _mm_f32(dz, w) if dz.dtype != self.mdt else dz @ w
        if self.gw is not None:
            self.gw.add(dz, hidden[a:e])
        if self.gb is not None:
            self.gb += dz.sum(0, dtype=self.mdt)

    def results(self, group, weight_dtype):
        gh = None if self.gh is None else funcol.all_reduce(self.gh, "sum", group)
        if isinstance(gh, funcol.AsyncCollectiveTensor):  # eager: a plain tensor back
            gh = gh.wait()
        return gh, None if self.gw is None else self.gw.result(weight_dtype), self.gb


class _VocabParallelLinearCE(torch.autograd.Function):
    """Scalar losses form the gradients in the forward, chunk by chunk while the logits
    are at hand (3 GEMMs, like the op; each chunk's statistics are all-reduced before
    its gradient); the backward only scales them. reduction="none", float16 (see
    ops/linear_ce.py) and no-grad calls recompute the logits in the backward instead."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, group, start, V, opts,
                reduction, z_loss, accumulator, grad_enabled):
        w, b, cw, W, col = _shard(hidden, weight, bias, target, class_weight, start, V, opts)
        mdt = math_dtype_for(hidden.dtype)
        stats, grad, chunks = _row_math(hidden, V, group)
        needs = [grad_enabled and n for n in ctx.needs_input_grad[:3]]
        eager = any(needs) and reduction != "none" and hidden.dtype != torch.float16
        # A target outside [0, V) lives on no rank: NaN, as on one device (not lse).
        valid, w_y = counted_target_weights(target, class_weight, opts.ignore_index, V, mdt)
        if eager:
            ce_scale, z_scale = grad_scales(target, class_weight, opts.ignore_index,
                                            reduction, z_loss, mdt)
            grads = _ShardGrads(hidden, weight, accumulator, needs, mdt)
        smoothing = opts.label_smoothing > 0.0
        lse, z_y, wz = (hidden.new_empty(hidden.shape[0], dtype=mdt) for _ in range(3))
        for a, e in chunks:
            logits = F.linear(hidden[a:e], w, b)
            lse_here, z_y_here, zsum = stats(logits, col[a:e], cw, opts, mdt)
            M = funcol.all_reduce(lse_here, "max", group)
            parts = [torch.exp(lse_here - M), z_y_here] + ([zsum] if smoothing else [])
            sums = funcol.all_reduce(torch.stack(parts), "sum", group)
            lse[a:e], z_y[a:e] = M + sums[0].log(), sums[1]
            if smoothing:
                wz[a:e] = sums[2]
            if eager:
                coeffs = grad_coefficients(ce_scale[a:e], z_scale[a:e], w_y[a:e], lse[a:e],
                                           W, V, opts.label_smoothing)
                grads.add(a, e, grad(logits, col[a:e], cw, lse[a:e], *coeffs, opts, mdt),
                          hidden, w)
            del logits  # freed before the next chunk is allocated
        smooth = torch.where(valid, W * lse - wz, 0.0) if smoothing else None
        loss = reduce_loss(torch.where(valid, w_y * (lse - z_y), 0.0), smooth, lse, target, class_weight,
                           opts.ignore_index, reduction, opts.label_smoothing, z_loss, V)
        ctx.eager = eager
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        if eager:  # float32 sums kept until the upstream gradient scales them
            ctx.save_for_backward(*grads.results(group, torch.promote_types(
                weight.dtype, mdt)))
        else:
            ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
            ctx.args = (group, start, V, opts, reduction, z_loss, accumulator)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.eager:
            grads = ctx.saved_tensors
        else:
            grads = _VocabParallelLinearCE._recompute(ctx, grad_loss)
            grad_loss = None
        return tuple(None if g is None else (g if grad_loss is None else g * grad_loss).to(dt)
                     for g, dt in zip(grads, ctx.dtypes)) + (None,) * 10

    @staticmethod
    def _recompute(ctx, grad_loss):
        hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        group, start, V, opts, reduction, z_loss, accumulator = ctx.args
        w, b, cw, W, col = _shard(hidden, weight, bias, target, class_weight, start, V, opts)
        mdt = math_dtype_for(hidden.dtype)
        _, grad, chunks = _row_math(hidden, V, group)
        _, w_y = counted_target_weights(target, class_weight, opts.ignore_index, V, mdt)
        ce_scale, z_scale = grad_scales(target, class_weight, opts.ignore_index, reduction,
                                        z_loss, mdt, grad_loss=grad_loss)
        A, B, C = grad_coefficients(ce_scale, z_scale, w_y, lse, W, V, opts.label_smoothing)
        grads = _ShardGrads(hidden, weight, accumulator, ctx.needs_input_grad[:3], mdt)
        for a, e in chunks:
            dz = grad(F.linear(hidden[a:e], w, b), col[a:e], cw, lse[a:e], A[a:e], B[a:e],
                      None if C is None else C[a:e], opts, mdt)
            grads.add(a, e, dz, hidden, w)
            del dz  # freed before the next chunk is allocated
        return grads.results(group, weight.dtype)


def _logprob_chunk(hidden, w, b, col, inv_t, opts, mdt, group, start, V, argmax=True):
    """One token chunk of the vocab-parallel log-probs (the math of ops/logprob_rows.py):
    (z, tanh, M, log_s, d, z_y, argmax). The rank reduces its shard's logits z =
    softcap(l) / T to the shard's max, sum of exp, sum of exp * (z - max), target logit
    and argmax; one max and one stacked sum all-reduce give the global max M, log s and
    d = mu - M (each (n,)), the target's logit z_y and, unless argmax=False (then None:
    two collectives fewer), the first most likely class."""
    c, tanh = softcapped(F.linear(hidden, w, b), opts.softcap, mdt)
    best, where = first_max(c) if argmax else (None, None)
    z = c.mul_(inv_t[:, None])
    m = z.amax(-1).clamp_min(torch.finfo(mdt).min)
    ex = (z - m[:, None]).exp_()
    zy = torch.where(col >= 0, z.gather(1, col.clamp_min(0).long()[:, None]).squeeze(1), 0.0)
    M = funcol.all_reduce(m, "max", group)
    scale = torch.exp(m - M)
    # As one device: sums of exp(z - M) and of exp(z - M) (z - M), with no 0 * -inf and
    # no cancellation against M.
    s_here = ex.sum(-1)
    ez_here = torch.where(ex > 0, ex * (z - m[:, None]), 0.0).sum(-1)
    del ex
    sums = funcol.all_reduce(torch.stack(
        [s_here * scale, rebased_ez(ez_here, s_here, m, M) * scale, zy]), "sum", group)
    log_s, d, z_y = sums[0].log(), sums[1] / sums[0], sums[2]
    if not argmax:
        return z, tanh, M, log_s, d, z_y, None
    # The first most likely class overall: the lowest index among the ranks holding
    # the maximum.
    top = funcol.all_reduce(best, "max", group)
    idx = torch.where(best == top, where + start, V)
    return z, tanh, M, log_s, d, z_y, funcol.all_reduce(idx, "min", group)


def _logprob_shard_dz(z, tanh, M, log_s, d, g, h, col, inv_t, valid, dtype):
    """The shard's logits gradient for upstream gradients g (log-prob) and h (entropy,
    or None), from z = softcap(l) / T (overwritten) and the global statistics: p and
    z - mu formed from z - M, exact near the maximum."""
    z = z.sub_(M[:, None])
    p = (z - log_s[:, None]).exp_()
    ent_term = None if h is None else torch.where(p > 0, p * h[:, None] * (z - d[:, None]),
                                                  0.0)
    dz = p.mul_(-g[:, None])
    if ent_term is not None:
        dz.sub_(ent_term)
    dz.scatter_add_(1, col.clamp_min(0).long()[:, None], torch.where(col >= 0, g, 0.0)[:, None])
    dz.mul_(inv_t[:, None])
    if tanh is not None:
        dz.mul_(1.0 - tanh * tanh)
    return dz.masked_fill_(~valid[:, None], 0.0).to(dtype)


class _VocabParallelLogProbs(torch.autograd.Function):
    """linear_logprobs with the head's rows split across the group: per chunk
    _logprob_chunk's statistics; the backward recomputes the shard's logits and forms
    their gradient with the global statistics relative to the global max (log s and
    d = mu - M, as ops/logprob_rows.py keeps them). The row math is PyTorch's on every
    device."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, inv_t, group, start, V, opts, entropy,
                accumulator):
        w, b, _, _, col = _shard(hidden, weight, bias, target, None, start, V, opts)
        mdt = math_dtype_for(hidden.dtype)
        N = hidden.shape[0]
        lse, z_y, ent = (hidden.new_empty(N, dtype=mdt) for _ in range(3))
        row_stats = hidden.new_empty(N, 3, dtype=mdt)  # (M, log s, d)
        argmax = hidden.new_empty(N, dtype=torch.int64)
        for a, e in _row_math(hidden, V, group)[2]:
            _, _, M, log_s, d, z_y[a:e], argmax[a:e] = _logprob_chunk(
                hidden[a:e], w, b, col[a:e], inv_t[a:e], opts, mdt, group, start, V)
            lse[a:e], ent[a:e] = M + log_s, log_s - d
            row_stats[a:e] = torch.stack([M, log_s, d], 1)
        valid = target != opts.ignore_index
        in_range = (target >= 0) & (target < V)
        logprob = torch.where(valid, torch.where(in_range, z_y - lse, float("nan")), 0.0)
        ent = torch.where(valid, ent, 0.0) if entropy else hidden.new_empty(0, dtype=mdt)
        ctx.mark_non_differentiable(lse, argmax)
        ctx.set_materialize_grads(False)  # an unused output costs no gradient pass
        ctx.save_for_backward(hidden, weight, bias, target, inv_t, row_stats)
        ctx.args = (group, start, V, opts, accumulator)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return logprob, ent, lse, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_h, *_):
        hidden, weight, bias, target, inv_t, row_stats = ctx.saved_tensors
        M, log_s, d = row_stats.unbind(1)
        group, start, V, opts, accumulator = ctx.args
        if g_lp is None and (g_h is None or g_h.numel() == 0):
            return (None,) * 11
        w, b, _, _, col = _shard(hidden, weight, bias, target, None, start, V, opts)
        mdt = math_dtype_for(hidden.dtype)
        valid = target != opts.ignore_index
        g = torch.zeros_like(M) if g_lp is None else g_lp.to(mdt)
        h = None if g_h is None or g_h.numel() == 0 else g_h.to(mdt)
        grads = _ShardGrads(hidden, weight, accumulator, ctx.needs_input_grad[:3], mdt)
        for a, e in _row_math(hidden, V, group)[2]:
            c, tanh = softcapped(F.linear(hidden[a:e], w, b), opts.softcap, mdt)
            dz = _logprob_shard_dz(c.mul_(inv_t[a:e, None]), tanh, M[a:e], log_s[a:e],
                                   d[a:e], g[a:e], None if h is None else h[a:e], col[a:e],
                                   inv_t[a:e], valid[a:e], hidden.dtype)
            grads.add(a, e, dz, hidden, w)
            del c, dz  # freed before the next chunk is allocated
        out = grads.results(group, weight.dtype)
        return tuple(None if t is None else t.to(dt) for t, dt in zip(out, ctx.dtypes)) + \
            (None,) * 8


class _VocabParallelPolicyLoss(torch.autograd.Function):
    """linear_policy_loss with the head's rows split across the group: per chunk
    _logprob_chunk's global log-probs and entropies, ops/policy.py's terms and upstream
    gradients (the same on every rank), and the shard's logits gradient from the same
    chunk, so the gradients come with the forward (3 GEMMs); the backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, advantages, old, ref, token_weights, inv_t,
                group, start, V, opts, popts, accumulator, grad_enabled):
        w, b, _, _, col = _shard(hidden, weight, bias, target, None, start, V, opts)
        mdt = math_dtype_for(hidden.dtype)
        N = hidden.shape[0]
        needs = [grad_enabled and n for n in ctx.needs_input_grad[:3]]
        grads = _ShardGrads(hidden, weight, accumulator, needs, mdt) if any(needs) else None
        valid = target != opts.ignore_index
        in_range = (target >= 0) & (target < V)
        weights = policy.token_weights(token_weights, valid, mdt)
        out = [hidden.new_empty(N, dtype=mdt) for _ in range(6)]  # loss_t, logprob, ... kl
        for a, e in _row_math(hidden, V, group)[2]:
            z, tanh, M, log_s, d, z_y, _ = _logprob_chunk(
                hidden[a:e], w, b, col[a:e], inv_t[a:e], opts, mdt, group, start, V,
                argmax=False)
            v = valid[a:e]
            lp = torch.where(v, torch.where(in_range[a:e], z_y - M - log_s, float("nan")), 0.0)
            ent = torch.where(v, log_s - d, 0.0)
            terms = policy.policy_terms(
                lp, ent, v, advantages[a:e], None if old is None else old[a:e],
                None if ref is None else ref[a:e], weights[a:e], popts)
            out[0][a:e], out[1][a:e], out[2][a:e] = terms[0], lp, ent
            out[3][a:e], out[4][a:e], out[5][a:e] = terms[3:]
            if grads is not None:
                dz = _logprob_shard_dz(z, tanh, M, log_s, d, terms[1],
                                       terms[2] if popts.entropy_coef != 0.0 else None,
                                       col[a:e], inv_t[a:e], v, hidden.dtype)
                grads.add(a, e, dz, hidden, w)
                del dz
            del z, tanh  # freed before the next chunk is allocated
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        # float32 sums kept until the upstream gradient scales them
        ctx.save_for_backward(*(grads.results(group, torch.promote_types(weight.dtype, mdt))
                                if grads is not None else (None,) * 3))
        ctx.mark_non_differentiable(*out[1:])
        return (out[0].sum(), *out[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        return tuple(None if g is None or grad_loss is None else (g * grad_loss).to(dt)
                     for g, dt in zip(ctx.saved_tensors, ctx.dtypes)) + (None,) * 13


def _check_tiling(hidden, weight, target, vocab_start, vocab_size, group):
    """Every rank sees every rank's shard, so all raise the same error (no hang). The
    token chunks too must agree (each chunk's statistics are all-reduced): they depend
    on each process's workspace setting and its GPU's memory."""
    N, D = target.numel(), hidden.shape[-1]
    chunk = _row_math(hidden.reshape(-1, D), vocab_size, group)[2][0][1] if N else 0
    mine = torch.tensor([vocab_start, weight.shape[0], N, D, vocab_size, chunk],
                        dtype=torch.int64, device=hidden.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = sorted(tuple(t.tolist()) for t in everyone)
    if len({r[2:5] for r in rows}) != 1:
        raise ValueError(f"hidden/target/vocab_size differ across ranks: (N, D, V) per "
                         f"rank = {[r[2:5] for r in rows]}")
    if len({r[5] for r in rows}) != 1:
        raise ValueError(f"the ranks cut different token chunks ({sorted({r[5] for r in rows})}"
                         " rows): give every rank the same torch_fce.set_workspace")
    ends = [0] + [start + size for start, size, *_ in rows]
    if [r[0] for r in rows] != ends[:-1] or ends[-1] != vocab_size:
        raise ValueError(f"vocab_start/weight shards do not tile [0, {vocab_size}): "
                         f"(start, rows) per rank = {[r[:2] for r in rows]}")


def vocab_parallel_linear_cross_entropy(
        hidden, weight, target, bias=None, class_weight=None, *, vocab_start, vocab_size,
        group=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
        z_loss=0.0, accumulator="fp32"):
    """torch_fce.linear_cross_entropy with the head's rows split across `group`.

    Args:
        hidden: (*, D), the same on every rank. target: (*), the same on every rank.
        weight: (Vs, D), this rank's rows [vocab_start, vocab_start + Vs) of the head.
        bias: (Vs,) this rank's slice, or None. class_weight: (vocab_size,), replicated.
        Other options as torch_fce.linear_cross_entropy.

    Returns:
        The loss (float32), identical on every rank: () or target.shape.
    """
    check_options(reduction, label_smoothing, softcap, z_loss, accumulator, ignore_index)
    check_inputs(hidden, weight, target, bias, None)  # class_weight spans all of V:
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor) or \
                class_weight.dtype not in checks.FLOAT_DTYPES:
            raise TypeError("class_weight must be a floating-point Tensor")
        if tuple(class_weight.shape) != (vocab_size,):
            raise ValueError(f"class_weight must have shape (vocab_size,) = ({vocab_size},), "
                             f"got {tuple(class_weight.shape)}")
        if class_weight.device != hidden.device:
            raise ValueError(f"class_weight is on {class_weight.device} but hidden is on "
                             f"{hidden.device}")
    group = group or dist.group.WORLD
    if not torch.compiler.is_compiling():
        _check_tiling(hidden, weight, target, vocab_start, vocab_size, group)
        if target.device.type == "cpu" or checks.CHECK_TARGETS:  # as the op (docs/api.md)
            checks.check_target_range(target, vocab_size, ignore_index)
    loss = _VocabParallelLinearCE.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), class_weight,
        group, vocab_start, vocab_size, RowOptions(ignore_index, label_smoothing, softcap),
        reduction, z_loss, accumulator,
        torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                        for t in (hidden, weight, bias)))
    return loss.reshape(target.shape) if reduction == "none" else loss


def vocab_parallel_linear_logprobs(hidden, weight, target, bias=None, *, vocab_start,
                                   vocab_size, group=None, temperature=None, softcap=None,
                                   ignore_index=-100, entropy=False, accumulator="fp32"):
    """torch_fce.linear_logprobs with the head's rows split across `group`.

    Args as vocab_parallel_linear_cross_entropy (hidden and target the same on every
    rank); temperature: as for linear_logprobs (a float > 0 or a float tensor
    broadcastable to target's shape), replicated.

    Returns:
        LogProbs, identical on every rank.
    """
    check_logprob_options(softcap, ignore_index, entropy, accumulator)
    check_inputs(hidden, weight, target, bias, None)
    temperature = temperature_tensor(1.0 if temperature is None else temperature, target)
    check_temperature(temperature, target)
    group = _checked_group(hidden, weight, target, temperature, vocab_start, vocab_size,
                           group, ignore_index)
    mdt = math_dtype_for(hidden.dtype)
    flat = target.reshape(-1)
    inv_t = inverse_temperature(None if temperature is None else temperature.reshape(-1),
                                flat.shape[0], hidden.device, mdt)
    out = _VocabParallelLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat, inv_t, group, vocab_start,
        vocab_size, RowOptions(ignore_index, 0.0, softcap), entropy, accumulator)
    shape = target.shape
    return LogProbs(out[0].reshape(shape), out[1].reshape(shape) if entropy else None,
                    out[2].reshape(shape), out[3].reshape(shape))


def _checked_group(hidden, weight, target, temperature, vocab_start, vocab_size, group,
                   ignore_index):
    """The group (WORLD by default), after the collective checks of the shards and, on
    the CPU or when asked for (a host sync), of the targets and temperatures."""
    group = group or dist.group.WORLD
    if not torch.compiler.is_compiling():
        _check_tiling(hidden, weight, target, vocab_start, vocab_size, group)
        if target.device.type == "cpu" or checks.CHECK_TARGETS:
            checks.check_target_range(target, vocab_size, ignore_index)
            checks.check_temperature_values(temperature)
    return group


def vocab_parallel_linear_policy_loss(
        hidden, weight, target, advantages, bias=None, *, vocab_start, vocab_size,
        group=None, old_logprobs=None, ref_logprobs=None, loss_type="clip", epsilon_low=0.2,
        epsilon_high=None, delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        beta=0.0, kl="k3", kl_ratio=False, entropy_coef=0.0, token_weights=None,
        temperature=1.0, softcap=None, ignore_index=-100, accumulator="fp32"):
    """torch_fce.linear_policy_loss with the head's rows split across `group`.

    Args as vocab_parallel_linear_cross_entropy (hidden, target and every per-token
    tensor the same on every rank) and linear_policy_loss.

    Returns:
        (loss, PolicyStats), identical on every rank.
    """
    temperature = temperature_tensor(1.0 if temperature is None else temperature, target)
    advantages = advantages_tensor(advantages, target)
    popts = policy.check_policy_inputs(
        hidden, weight, target, advantages, bias, old_logprobs, ref_logprobs, token_weights,
        temperature, loss_type, epsilon_low, epsilon_high, delta, sapo_temperature_pos,
        sapo_temperature_neg, beta, kl, kl_ratio, entropy_coef, softcap, ignore_index,
        accumulator)
    group = _checked_group(hidden, weight, target, temperature, vocab_start, vocab_size,
                           group, ignore_index)
    mdt = math_dtype_for(hidden.dtype)
    flat = [None if t is None else t.reshape(-1) for t in (target, advantages, old_logprobs,
                                                          ref_logprobs, token_weights)]
    inv_t = inverse_temperature(None if temperature is None else temperature.reshape(-1),
                                flat[0].shape[0], hidden.device, mdt)
    out = _VocabParallelPolicyLoss.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, *flat, inv_t, group, vocab_start,
        vocab_size, RowOptions(ignore_index, 0.0, softcap), popts, accumulator,
        torch.is_grad_enabled())
    return out[0], PolicyStats(*(t.reshape(target.shape) for t in out[1:]))


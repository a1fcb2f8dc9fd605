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

from ..ops import checks
from ..ops.accumulate import GradAccumulator, _mm_f32
from ..ops.checks import check_inputs, check_options
from ..ops.chunked import math_dtype_for
from ..ops.rows import (RowOptions, grad_coefficients, torch_shard_grad,
                        torch_shard_stats)
from ..ops.tokens import counted_target_weights, grad_scales, reduce_loss
from ..ops.workspace import chunk_rows

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


def _check_tiling(hidden, weight, target, vocab_start, vocab_size, group):
    """Every rank sees every rank's shard, so all raise the same error (no hang)."""
    mine = torch.tensor([vocab_start, weight.shape[0], target.numel(), hidden.shape[-1],
                         vocab_size], dtype=torch.int64, device=hidden.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = sorted(tuple(t.tolist()) for t in everyone)
    if len({r[2:] for r in rows}) != 1:
        raise ValueError(f"hidden/target/vocab_size differ across ranks: (N, D, V) per "
                         f"rank = {[r[2:] for r in rows]}")
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
        if target.device.type == "cpu" or checks.CHECK_TARGETS:  # as the op (API.md)
            checks.check_target_range(target, vocab_size, ignore_index)
    loss = _VocabParallelLinearCE.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), class_weight,
        group, vocab_start, vocab_size, RowOptions(ignore_index, label_smoothing, softcap),
        reduction, z_loss, accumulator,
        torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                        for t in (hidden, weight, bias)))
    return loss.reshape(target.shape) if reduction == "none" else loss

"""Vocab-parallel linear cross-entropy: the lm head's rows are split across a group.

Each rank holds rows [vocab_start, vocab_start + Vs) of the (V, D) head (Megatron's
column-parallel lm head) and the full hidden states and targets. Per token chunk a rank
forms its shard's logits and reduces them to four O(N) vectors (max, sum of exp, target
logit, weighted logit sum); one all-reduce of those gives every rank the global
logsumexp and loss. The backward recomputes the shard's logits, forms dz with the
global lse (the same formula as one device: ops/rows.logits_grad_), keeps dW and db
local and all-reduces the hidden gradient's float32 partial sums. Collectives are
functional (torch.distributed._functional_collectives) so torch.compile can trace them.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ..ops.accumulate import GradAccumulator, _mm_f32
from ..ops.checks import check_inputs, check_options
from ..ops.chunked import math_dtype_for
from ..ops.cpu import _chunk_rows
from ..ops.rows import RowOptions, logits_grad_, softcapped
from ..ops.tokens import grad_scales, reduce_loss, target_weights

def _chunks(N, Vs):
    """Token chunks whose shard logits fit the CPU backend's workspace."""
    rows = _chunk_rows(Vs)
    return [(s, min(N, s + rows)) for s in range(0, N, rows)]


def _shard(hidden, weight, bias, target, class_weight, start, V, opts):
    """What forward and backward both derive: the head in hidden's dtype, the class
    weights (whole and this shard's), their sum W, and each target's column in the
    shard with where it lives here."""
    mdt = math_dtype_for(hidden.dtype)
    Vs = weight.shape[0]
    w, b = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)
    cw = None if class_weight is None else class_weight.to(mdt)
    cw_shard = None if cw is None else cw[start:start + Vs]
    W = float(V) if cw is None else cw.sum()
    here = (target >= start) & (target < start + Vs) & (target != opts.ignore_index)
    tgt = torch.where(here, target - start, 0).long()
    return mdt, w, b, cw_shard, W, tgt, here


class _VocabParallelLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, group, start, V, opts,
                reduction, z_loss, accumulator):
        mdt, w, b, cw_shard, W, tgt, here = _shard(hidden, weight, bias, target,
                                                   class_weight, start, V, opts)
        N, Vs = hidden.shape[0], weight.shape[0]
        m, s, z_y, wz = (hidden.new_zeros(N, dtype=mdt) for _ in range(4))
        for a, e in _chunks(N, Vs):
            z, _ = softcapped(F.linear(hidden[a:e], w, b), opts.softcap, mdt)
            z_y[a:e] = torch.where(here[a:e], z.gather(1, tgt[a:e, None]).squeeze(1), 0.0)
            if opts.label_smoothing > 0.0:
                wz[a:e] = z.sum(-1) if cw_shard is None else z @ cw_shard
            m[a:e] = z.amax(-1).clamp_min(torch.finfo(mdt).min)
            s[a:e] = z.sub_(m[a:e, None]).exp_().sum(-1)
        M = funcol.all_reduce(m, "max", group)
        lse = M + funcol.all_reduce(s * torch.exp(m - M), "sum", group).log()
        z_y = funcol.all_reduce(z_y, "sum", group)
        valid, w_y = target_weights(target, class_weight, opts.ignore_index, mdt)
        smooth = torch.zeros_like(lse)
        if opts.label_smoothing > 0.0:
            smooth = torch.where(valid, W * lse - funcol.all_reduce(wz, "sum", group), 0.0)
        loss = reduce_loss(w_y * (lse - z_y), smooth, lse, target, class_weight,
                           opts.ignore_index, reduction, opts.label_smoothing, z_loss, V)
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
        ctx.args = (group, start, V, opts, reduction, z_loss, accumulator)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        group, start, V, opts, reduction, z_loss, accumulator = ctx.args
        mdt, w, b, cw_shard, W, tgt, here = _shard(hidden, weight, bias, target,
                                                   class_weight, start, V, opts)
        (N, D), Vs = hidden.shape, weight.shape[0]
        _, w_y = target_weights(target, class_weight, opts.ignore_index, mdt)
        ce_scale, z_scale = grad_scales(target, class_weight, opts.ignore_index, reduction,
                                        z_loss, mdt, grad_loss=grad_loss)
        gh = hidden.new_zeros(N, D, dtype=mdt)  # float32 partial sums, all-reduced
        gw = GradAccumulator(accumulator, (Vs, D), hidden.dtype, weight.dtype, hidden.device)
        gb = hidden.new_zeros(Vs, dtype=mdt)
        for a, e in _chunks(N, Vs):
            z, tanh = softcapped(F.linear(hidden[a:e], w, b), opts.softcap, mdt)
            p = z.sub_(lse[a:e, None]).exp_()
            dz = logits_grad_(p, 1.0, tgt[a:e], here[a:e].to(mdt), w_y[a:e], lse[a:e],
                              cw_shard, W, V, ce_scale[a:e], z_scale[a:e], opts, tanh)
            dz = dz.to(hidden.dtype)
            gh[a:e] = _mm_f32(dz, w) if dz.dtype != mdt else dz @ w
            gw.add(dz, hidden[a:e])
            gb += dz.sum(0, dtype=mdt)
        gh = funcol.all_reduce(gh, "sum", group).to(hidden.dtype)
        grad_b = None if bias is None else gb.to(bias.dtype)
        return (gh, gw.result(weight.dtype), grad_b) + (None,) * 9


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
    check_inputs(hidden, weight, target, bias, None)
    if class_weight is not None and tuple(class_weight.shape) != (vocab_size,):
        raise ValueError(f"class_weight must have shape (vocab_size,) = ({vocab_size},), got "
                         f"{tuple(class_weight.shape)}")
    group = group or dist.group.WORLD
    if not torch.compiler.is_compiling():
        _check_tiling(hidden, weight, target, vocab_start, vocab_size, group)
    loss = _VocabParallelLinearCE.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), class_weight,
        group, vocab_start, vocab_size, RowOptions(ignore_index, label_smoothing, softcap),
        reduction, z_loss, accumulator)
    return loss.reshape(target.shape) if reduction == "none" else loss

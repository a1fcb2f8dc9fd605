"""DTensor entry: a weight sharded by vocabulary (Shard(0)) runs the vocab-parallel loss,
log-probs, policy loss, distillation, sparse divergence and sparse-target cross
entropy."""

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import vocab_parallel as vp


def _local(t):
    if not isinstance(t, DTensor):
        return t
    if any(not isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"with a vocab-sharded weight, hidden/target/class_weight must be "
                         f"replicated, got placements {t.placements}")
    return t.to_local()


def _vocab_shard(weight, bias):
    """(group, vocab_start, vocab_size) of a weight sharded on dim 0 along one mesh
    dimension (replicated on any other), bias with the same placements."""
    dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    if len(dims) != 1 or weight.placements[dims[0]].dim != 0 or any(
            not isinstance(p, (Shard, Replicate)) for p in weight.placements):
        raise ValueError(f"weight must be a DTensor sharded on dim 0 (vocabulary) along one "
                         f"mesh dimension, got placements {weight.placements}")
    if bias is not None and (not isinstance(bias, DTensor)
                             or tuple(bias.placements) != tuple(weight.placements)):
        raise ValueError("bias must be a DTensor with weight's placements")
    mesh = weight.device_mesh
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    return mesh.get_group(dims[0]), offset[0], weight.shape[0]


def dtensor_linear_cross_entropy(hidden, weight, target, bias, class_weight, opts):
    """Loss for a vocab-sharded DTensor weight (opts: a CEOptions); the result, a plain tensor, is the same on
    every rank."""
    group, start, V = _vocab_shard(weight, bias)
    return vp.vocab_parallel_linear_cross_entropy(
        _local(hidden), weight.to_local(), _local(target),
        None if bias is None else bias.to_local(), _local(class_weight),
        vocab_start=start, vocab_size=V, group=group, **opts._asdict())


def dtensor_linear_logprobs(hidden, weight, target, bias, temperature, opts):
    """linear_logprobs for a vocab-sharded DTensor weight; plain outputs, the same on
    every rank."""
    group, start, V = _vocab_shard(weight, bias)
    return vp.vocab_parallel_linear_logprobs(
        _local(hidden), weight.to_local(), _local(target),
        None if bias is None else bias.to_local(), temperature=_local(temperature),
        vocab_start=start, vocab_size=V, group=group, **opts._asdict())


def dtensor_linear_policy_loss(hidden, weight, target, advantages, bias, tensors, opts):
    """linear_policy_loss for a vocab-sharded DTensor weight (tensors: a PolicyTensors):
    (loss, PolicyStats), plain tensors, the same on every rank."""
    group, start, V = _vocab_shard(weight, bias)
    return vp.vocab_parallel_linear_policy_loss(
        _local(hidden), weight.to_local(), _local(target), _local(advantages),
        None if bias is None else bias.to_local(),
        **{name: _local(t) for name, t in tensors._asdict().items()},
        vocab_start=start, vocab_size=V, group=group, **opts._asdict())



def dtensor_linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, tensors,
                                     opts):
    """linear_distillation_loss for vocab-sharded DTensor heads (both sharded alike;
    tensors: a DistillTensors): (loss,
    DistillationStats), plain tensors, the same on every rank."""
    target, bias, teacher_bias, token_weights, temperature = tensors
    group, start, V = _vocab_shard(weight, bias)
    if not isinstance(teacher_weight, DTensor) or \
            tuple(teacher_weight.placements) != tuple(weight.placements) or \
            teacher_weight.device_mesh != weight.device_mesh:
        raise ValueError("teacher_weight must be a DTensor with weight's mesh and "
                         "placements (both heads sharded alike by vocabulary)")
    if teacher_bias is not None and (not isinstance(teacher_bias, DTensor) or tuple(
            teacher_bias.placements) != tuple(weight.placements)):
        raise ValueError("teacher_bias must be a DTensor with weight's placements")
    return vp.vocab_parallel_linear_distillation_loss(
        _local(hidden), weight.to_local(), _local(teacher_hidden), teacher_weight.to_local(),
        _local(target), None if bias is None else bias.to_local(),
        None if teacher_bias is None else teacher_bias.to_local(),
        token_weights=_local(token_weights), temperature=_local(temperature),
        vocab_start=start, vocab_size=V, group=group, **opts._asdict())


def dtensor_sparse(name, hidden, weight, idx, values, tensors, opts):
    """fce::<name>'s outputs (linear_sparse_divergence's or linear_soft_cross_entropy's,
    sparse per-token targets idx and values) for a vocab-sharded DTensor weight (tensors:
    the op's record of bias, token_weights, temperature): through its vocab-parallel
    form, plain tensors, the same on every rank."""
    group, start, V = _vocab_shard(weight, tensors.bias)
    out = _SPARSE[name](_local(hidden), weight.to_local(), _local(idx), _local(values),
                        None if tensors.bias is None else tensors.bias.to_local(),
                        token_weights=_local(tensors.token_weights),
                        temperature=_local(tensors.temperature), vocab_start=start,
                        vocab_size=V, group=group, **opts._asdict())
    return out if isinstance(out, torch.Tensor) else (out[0], *out[1])


def dtensor_linear_topk_logprobs(hidden, weight, tensors, opts):
    """linear_topk_logprobs for a vocab-sharded DTensor head (tensors: a TopKTensors):
    the raw outputs (indices, logprobs, target_logprob), the same on every rank."""
    group, start, V = _vocab_shard(weight, tensors.bias)
    out = vp.vocab_parallel_linear_topk_logprobs(
        _local(hidden), weight.to_local(), opts.k,
        None if tensors.bias is None else tensors.bias.to_local(), vocab_start=start,
        vocab_size=V, group=group, target=_local(tensors.target),
        temperature=_local(tensors.temperature),
        **{name: v for name, v in opts._asdict().items() if name != "k"})
    return out[0], out[1], out[2]


_SPARSE = {"linear_sparse_divergence": vp.vocab_parallel_linear_sparse_divergence,
           "linear_soft_cross_entropy": vp.vocab_parallel_linear_soft_cross_entropy}

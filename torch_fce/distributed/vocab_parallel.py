"""Vocab-parallel entry points: the head's rows split across a process group.

Each rank holds rows [vocab_start, vocab_start + Vs) of the (V, D) head (Megatron's
column-parallel lm head) and the full hidden states, targets and per-token tensors.
These are the single-device ops with a `VocabShard` (ops/loop/chunked.py): the same custom ops,
fake kernels, autograd and chunk loop, whose row functions all-reduce each chunk's
per-row statistics (functional collectives, run inside the op: under torch.compile the
loss is one custom-op node with its fake kernel) before any
gradient is formed; the weight and bias gradients stay local, the hidden gradient's
float32 partial sums are all-reduced once. Here: the collective checks that every rank
agrees on the tiling (before the op, outside torch.compile) and the result types.
"""

from ..ops import (linear_ce, linear_distillation, linear_logprobs, linear_policy_loss,
                   linear_soft_ce, linear_sparse_divergence, linear_topk_logprobs)
from ..ops.contract.entry import advantages_tensor, temperature_tensor
from ..ops.machinery.shards import checked_shard
from ..results import (DistillationStats, LogProbs, PolicyStats, SparseDivergenceStats,
                       TopKLogprobs)

def vocab_parallel_linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None,
                                        *, vocab_start, vocab_size, group=None, **options):
    """torch_fce.linear_cross_entropy with the head's rows split across `group`.

    Args:
        hidden: (*, D), the same on every rank. target: (*), the same on every rank.
        weight: (Vs, D), this rank's rows [vocab_start, vocab_start + Vs) of the head.
        bias: (Vs,) this rank's slice, or None. class_weight: (vocab_size,), replicated.
        options: as torch_fce.linear_cross_entropy's (ignore_index, reduction, ...).

    Returns:
        The loss (float32), identical on every rank: () or target.shape.
    """
    opts = linear_ce.CEOptions(**options).check()
    shard = checked_shard(hidden, weight, target, vocab_start, vocab_size, group, class_weight)
    return linear_ce.forward(hidden, weight, target, bias, class_weight, opts, False,
                             shard)[0]


def vocab_parallel_linear_logprobs(hidden, weight, target, bias=None, *, vocab_start,
                                   vocab_size, group=None, temperature=None, **options):
    """torch_fce.linear_logprobs with the head's rows split across `group`.

    Args as vocab_parallel_linear_cross_entropy (hidden and target the same on every
    rank); temperature: as for linear_logprobs (a float > 0 or a float tensor
    broadcastable to target's shape), replicated; options as linear_logprobs'.

    Returns:
        LogProbs, identical on every rank.
    """
    opts = linear_logprobs.LogProbOptions(**options).check()
    temperature = temperature_tensor(1.0 if temperature is None else temperature, target)
    shard = checked_shard(hidden, weight, target, vocab_start, vocab_size, group)
    out = linear_logprobs.forward(hidden, weight, target, bias, temperature, opts, shard)
    return LogProbs(out[0], out[1] if opts.entropy else None, out[2], out[3])


def vocab_parallel_linear_policy_loss(hidden, weight, target, advantages, bias=None, *,
                                      vocab_start, vocab_size, group=None,
                                      old_logprobs=None, ref_logprobs=None,
                                      token_weights=None, temperature=1.0, **options):
    """torch_fce.linear_policy_loss with the head's rows split across `group`.

    Args as vocab_parallel_linear_cross_entropy (hidden, target and every per-token
    tensor the same on every rank); options as linear_policy_loss'.

    Returns:
        (loss, PolicyStats), identical on every rank.
    """
    opts = linear_policy_loss.PolicyOptions(**options).check()
    temperature = temperature_tensor(1.0 if temperature is None else temperature, target)
    advantages = advantages_tensor(advantages, target)
    shard = checked_shard(hidden, weight, target, vocab_start, vocab_size, group)
    tensors = linear_policy_loss.PolicyTensors(
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, token_weights=token_weights,
        temperature=temperature)
    loss, *stats = linear_policy_loss.forward(hidden, weight, target, advantages, bias,
                                              tensors, opts, shard)
    return loss, PolicyStats(*stats)


def vocab_parallel_linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight,
                                            target=None, bias=None, teacher_bias=None, *,
                                            vocab_start, vocab_size, group=None,
                                            temperature=1.0, token_weights=None, **options):
    """torch_fce.linear_distillation_loss with both heads' rows split alike across
    `group`.

    Args:
        hidden, teacher_hidden, target and the per-token tensors: the same on every rank.
        weight (Vs, D), teacher_weight (Vs, D_t): this rank's rows [vocab_start,
        vocab_start + Vs) of each head; bias, teacher_bias: their slices, or None.
        options: as linear_distillation_loss' keywords but shift (shift the target
        first).

    Returns:
        (loss, DistillationStats), identical on every rank.
    """
    opts = linear_distillation.DistillOptions(**options).check()
    tokens = linear_distillation.tokens_of(hidden, target)
    temperature = temperature_tensor(1.0 if temperature is None else temperature, tokens)
    shard = checked_shard(hidden, weight, tokens, vocab_start, vocab_size, group)
    loss, *stats = linear_distillation.forward(
        hidden, weight, teacher_hidden, teacher_weight,
        linear_distillation.DistillTensors(target=target, bias=bias, teacher_bias=teacher_bias,
                                           token_weights=token_weights,
                                           temperature=temperature), opts, shard)
    return loss, DistillationStats(*stats)


def vocab_parallel_linear_sparse_divergence(hidden, weight, support, teacher_logprobs,
                                            bias=None, *, vocab_start, vocab_size,
                                            group=None, temperature=1.0, token_weights=None,
                                            **options):
    """torch_fce.linear_sparse_divergence with the student head's rows split across
    `group`: the support holds whole-vocabulary classes (the same on every rank, as
    hidden, teacher_logprobs and the per-token tensors), each support class's student
    log-prob comes from the rank holding it.

    Returns:
        (loss, SparseDivergenceStats), identical on every rank.
    """
    opts = linear_sparse_divergence.SparseDivOptions(**options).check()
    tokens = support[..., 0]
    temperature = temperature_tensor(1.0 if temperature is None else temperature, tokens)
    shard = checked_shard(hidden, weight, tokens, vocab_start, vocab_size, group)
    loss, *stats = linear_sparse_divergence.forward(
        hidden, weight, support, teacher_logprobs,
        linear_sparse_divergence.SparseDivTensors(bias=bias, token_weights=token_weights,
                                                  temperature=temperature), opts, shard)
    return loss, SparseDivergenceStats(*stats)


def vocab_parallel_linear_soft_cross_entropy(hidden, weight, target_indices, target_probs,
                                             bias=None, *, vocab_start, vocab_size,
                                             group=None, temperature=1.0, token_weights=None,
                                             **options):
    """torch_fce.linear_soft_cross_entropy with the head's rows split across `group`
    (target_indices: whole-vocabulary classes, the same on every rank).

    Returns:
        The loss, identical on every rank.
    """
    opts = linear_soft_ce.SoftCEOptions(**options).check()
    tokens = target_indices[..., 0]
    temperature = temperature_tensor(1.0 if temperature is None else temperature, tokens)
    shard = checked_shard(hidden, weight, tokens, vocab_start, vocab_size, group)
    return linear_soft_ce.forward(
        hidden, weight, target_indices, target_probs,
        linear_soft_ce.SoftCETensors(bias=bias, token_weights=token_weights,
                                     temperature=temperature), opts, shard)


def vocab_parallel_linear_topk_logprobs(hidden, weight, k, bias=None, *, vocab_start,
                                        vocab_size, group=None, target=None,
                                        temperature=1.0, **options):
    """torch_fce.linear_topk_logprobs with the teacher head's rows split across `group`:
    each rank's k candidates merged as one device picks them (equal probabilities by
    ascending class); hidden, target and temperature the same on every rank.

    Returns:
        TopKLogprobs (whole-vocabulary indices), identical on every rank.
    """
    opts = linear_topk_logprobs.TopKOptions(k=k, **options).check()
    tokens = target if target is not None else hidden[..., 0]
    temperature = temperature_tensor(1.0 if temperature is None else temperature, tokens)
    shard = checked_shard(hidden, weight, tokens.long(), vocab_start, vocab_size, group)
    out = linear_topk_logprobs.forward(
        hidden, weight, linear_topk_logprobs.TopKTensors(bias=bias, target=target,
                                                         temperature=temperature),
        opts, shard)
    return TopKLogprobs(out[0], out[1], None if target is None else out[2])

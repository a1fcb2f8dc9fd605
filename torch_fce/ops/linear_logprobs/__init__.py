"""The log-probs' room: fce::linear_logprobs, whole.

Its options (LogProbOptions), the schemas, the public op's entry, the fake kernels,
the autograd formula and the implementation on the chunk loop (token chunks or
vocabulary tiles; one device or a vocabulary shard). Every output is per token, so the
forward forms no gradient: the backward recomputes the logits with the upstream
gradients and the forward's row statistics.
"""

from typing import NamedTuple, Optional

import torch

from ..contract import checks
from ..contract.entry import (autocast_operands, flat, int64_if_needed, refuse_transforms,
                             token_rows)
from ..contract.options import check_bool, schema_args, take
from ..loop.chunked import (GEMM_TILE, ONE_DEVICE, VocabShard, after_first_gemm, by_vocab,
                           chunk_rows_for, grad_outputs, inverse_temperature,
                           logits_dtype_for, math_dtype_for, no_autocast, run_chunks)
from ..machinery import grads
from ..machinery.dispatch import LIB, kernel
from . import truncation
from .truncation_rows import TORCH_TRUNCATION_ROWS
from .rows import (TORCH_LOGPROB_ROWS, TileStats, all_reduce_tile_stats, empty_tile_stats,
                   finish_stats)


class LogProbOptions(NamedTuple):
    """linear_logprobs' options (docs/rl.md), in the schemas' order; accumulator is for
    the backward's weight-gradient sum."""
    softcap: Optional[float] = None
    ignore_index: int = -100
    entropy: bool = False
    accumulator: str = "fp32"
    logits_dtype: Optional[torch.dtype] = None  # torch.float32: the GEMM's float32 sums
    # the sampler's truncation (truncation.py): its distribution's log-probs
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    def check(self):
        """Raises naming the option; returns self."""
        checks.check_common(self)
        check_bool("entropy", self.entropy)
        checks.check_truncation(self)
        return self


_OPTS, _SHARD = schema_args(LogProbOptions), schema_args(VocabShard)
# The log-softmax of softcap(logits) / temperature at target, its entropy, logsumexp
# and argmax, each target.shape (entropy (0,) unless entropy=True). temperature: None
# (1) or target.shape.
LIB.define(
    "linear_logprobs(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
    f"Tensor? temperature=None, *, {schema_args(LogProbOptions, True)}) "
    "-> (Tensor logprob, Tensor entropy, Tensor lse, Tensor argmax)")
# hidden (N, D), target and temperature (N,). Also row_stats (N, 3), the per-token
# statistics relative to the row's max m of z: (m, log sum_c exp(z_c - m), sum_c p_c
# (z_c - m)) (the last 0 unless entropy); under a truncation those of the kept set, and
# its threshold (N, truncation.ROW_STATS). The backward recomputes the logits but not
# these, and forms p_c and z_c - mu from z_c - m, which is exact near the max: lse
# alone would lose 1 - p on confident rows.
LIB.define(
    "linear_logprobs_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
    f"Tensor? temperature, {_OPTS}, {_SHARD}) -> (Tensor logprob, Tensor entropy, "
    "Tensor lse, Tensor argmax, Tensor row_stats)")
LIB.define(
    "linear_logprobs_bwd(Tensor grad_logprob, Tensor? grad_entropy, Tensor row_stats, "
    "Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? temperature, "
    f"{_OPTS}, {_SHARD}, bool[3] needs_grad) "
    "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)")


# ---- the public op -----------------------------------------------------------------

def forward(hidden, weight, target, bias, temperature, opts, shard=ONE_DEVICE):
    """The op's outputs for checked options; also the vocab-parallel entry."""
    out = _fwd(hidden, weight, target, bias, temperature, opts, shard)
    shape = target.shape
    return (out[0].reshape(shape), out[1].reshape(shape) if opts.entropy else out[1],
            out[2].reshape(shape), out[3].reshape(shape))


def sampler_and_model_logprobs(hidden, weight, target, bias, temperature, opts):
    """(truncated, untruncated), each target.shape: the log-probs of the sampler's
    distribution (opts' truncation; -inf outside its kept set) and of the model's, from
    one pass, without gradient, for checked options (an integration's old-log-prob pass:
    TRL's importance-sampling weight takes the first, its PPO ratio the second)."""
    if not truncation.truncating(opts):
        raise ValueError("sampler_and_model_logprobs needs top_k, top_p or min_p")
    with torch.no_grad():
        out = _fwd(hidden, weight, target, bias, temperature, opts, ONE_DEVICE)
    return (out[0].reshape(target.shape),
            out[4][:, truncation.MODEL_LOGPROB].reshape(target.shape))


def _fwd(hidden, weight, target, bias, temperature, opts, shard):
    """linear_logprobs_fwd's outputs, flat, after the entry's checks and conversions."""
    refuse_transforms((hidden, weight, bias, temperature))
    hidden, weight, bias = autocast_operands(hidden, weight, bias)  # dtypes checked after
    checks.check_head_inputs(hidden, weight, target, bias, None)
    checks.check_temperature(temperature, target)
    target = int64_if_needed(target, opts.ignore_index)
    return torch.ops.fce.linear_logprobs_fwd(token_rows(hidden), weight, flat(target), bias,
                                             flat(temperature), *opts, *shard)


@torch.library.impl(LIB, "linear_logprobs", "CompositeImplicitAutograd")
def _linear_logprobs(hidden, weight, target, bias=None, temperature=None, **options):
    return forward(hidden, weight, target, bias, temperature,
                   LogProbOptions(**options).check())


# ---- fake kernels ------------------------------------------------------------------

@torch.library.register_fake("fce::linear_logprobs_fwd")
def _fwd_fake(hidden, weight, target, bias, temperature, *args):
    opts, rest = take(LogProbOptions, args)
    opts = opts.check()
    checks.check_head_inputs(hidden, weight, target, bias, None)
    checks.check_temperature(temperature, target)
    N, mdt = target.shape[0], torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty(N, dtype=mdt),
            hidden.new_empty(N if opts.entropy else 0, dtype=mdt),
            hidden.new_empty(N, dtype=mdt), hidden.new_empty(N, dtype=torch.int64),
            hidden.new_empty(N, _row_stats_width(opts), dtype=mdt))


def _row_stats_width(opts):
    return truncation.ROW_STATS if truncation.truncating(opts) else 3


@torch.library.register_fake("fce::linear_logprobs_bwd")
def _bwd_fake(grad_logprob, grad_entropy, row_stats, hidden, weight, target, bias,
              temperature, *args):
    (needs,) = take(VocabShard, take(LogProbOptions, args)[1])[1]
    return grads.fake_grads(hidden, weight, bias, needs, keep_f32=False)


# ---- autograd ----------------------------------------------------------------------

_HIDDEN_WEIGHT_BIAS = (0, 1, 3)  # their positions among linear_logprobs_fwd's arguments


def _setup(ctx, inputs, output):
    hidden, weight, target, bias, temperature, *args = inputs
    opts, rest = take(LogProbOptions, args)
    ctx.mark_non_differentiable(*output[2:])  # lse, argmax, row_stats
    ctx.set_materialize_grads(False)
    ctx.opts, ctx.shard = opts, take(VocabShard, rest)[0]
    # The forward's row statistics spare the backward a statistics pass over the logits
    # (an internal output: the user cannot edit it in place).
    ctx.save_for_backward(hidden, weight, target, bias, temperature, output[4])


def _backward(ctx, grad_logprob, grad_entropy, *_):
    """The logits are recomputed with both upstream gradients."""
    if not ctx.opts.entropy:
        grad_entropy = None
    if grad_logprob is None and grad_entropy is None:
        return grads.input_grads(ctx, _HIDDEN_WEIGHT_BIAS, ())
    *saved, row_stats = ctx.saved_tensors  # raises if an input was modified in place since
    needs = grads.needs(ctx, _HIDDEN_WEIGHT_BIAS)
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        if grad_logprob is None:
            grad_logprob = torch.zeros_like(saved[2], dtype=grad_entropy.dtype)
        out = torch.ops.fce.linear_logprobs_bwd(grad_logprob, grad_entropy, row_stats,
                                                *saved, *ctx.opts, *ctx.shard, needs)
    out = [g if need else None for g, need in zip(out, needs)]
    if create_graph:
        out = grads.first_order(out, (grad_logprob, grad_entropy, *saved))
    return grads.input_grads(ctx, _HIDDEN_WEIGHT_BIAS, out)


torch.library.register_autograd("fce::linear_logprobs_fwd", _backward, setup_context=_setup)


# ---- the implementation, on the chunk loop -----------------------------------------

def logprob_rows(backend):
    """The log-probs' row functions on the backend (rows.LogProbRows, also the policy
    loss's): the Triton kernels, or the PyTorch rows."""
    if backend.triton:
        from .kernels import TRITON_LOGPROB_ROWS
        return TRITON_LOGPROB_ROWS
    return TORCH_LOGPROB_ROWS


def truncation_rows(backend, opts, shard, vocab_size):
    """The sampler's truncation rows (the policy loss's too), None where the options
    truncate nothing: the backend's where they serve, else the PyTorch ones."""
    if not truncation.truncating(opts):
        return None
    if backend.triton:
        from .truncation_kernels import TRITON_TRUNCATION_ROWS as rows
    else:
        rows = TORCH_TRUNCATION_ROWS
    return rows if truncation.serves(rows, opts, shard, vocab_size) else TORCH_TRUNCATION_ROWS


@kernel("linear_logprobs_fwd")
def fwd(hidden, weight, target, bias, temperature, *args, backend):
    """(logprob, entropy, lse, argmax) each (N,), and row_stats (N, 3 or
    truncation.ROW_STATS); entropy (0,) unless asked for. Token chunks, whatever N
    (vocabulary tiles' boundaries would move with N, and each row's statistics with
    them: the outputs are batch-invariant) where the logits GEMMs are row-invariant,
    else cut as the backward (_cuts_vocab); tiles and a shard merge per-row statistics
    across their blocks of classes, then the group, then finish them (a truncation: its
    rows' kept set, truncation.kept_stats)."""
    opts, rest = take(LogProbOptions, args)
    shard = take(VocabShard, rest)[0]
    V = shard.vocab(weight)
    truncated = truncation_rows(backend, opts, shard, V)
    rows = logprob_rows(backend)
    if backend.check_values:
        checks.check_target_range(target, V, opts.ignore_index)
        checks.check_temperature_values(temperature)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    inv_t = after_first_gemm(lambda: inverse_temperature(temperature, N, hidden.device, mdt))
    out = [hidden.new_empty(N, dtype=mdt) for _ in range(3)] + [
        hidden.new_empty(N, dtype=torch.int64),
        hidden.new_empty(N, _row_stats_width(opts), dtype=mdt)]
    vocab = _cuts_vocab(hidden, weight, opts)[0]
    merged = vocab or (shard.group is not None and truncated is None)
    blocks = {}  # vocabulary tiles: the merged statistics of each block of tokens
    start = shard.vocab_start

    def row_fn(logits, s, e, r0=0, r1=None):
        if vocab:  # classes [s, e) of tokens [r0, r1)
            if r0 not in blocks:
                blocks[r0] = empty_tile_stats(r1 - r0, mdt, hidden.device)
            rows.tile_stats(logits, target[r0:r1], inv_t()[r0:r1], opts, opts.entropy, mdt,
                            start + s, blocks[r0])
            return (), None
        if truncated is not None:
            return truncation.kept_stats(truncated, logits, target[s:e], inv_t()[s:e], opts,
                                         mdt, shard), None
        if merged:  # a shard's classes of tokens [s, e)
            part = empty_tile_stats(e - s, mdt, hidden.device)
            rows.tile_stats(logits, target[s:e], inv_t()[s:e], opts, opts.entropy, mdt,
                            start, part)
            return part, None
        return rows.stats(logits, target[s:e], inv_t()[s:e], opts, opts.entropy,
                          mdt), None

    with no_autocast(hidden):
        # Token chunks of a shard write their partial statistics into a TileStats of N.
        parts = empty_tile_stats(N, mdt, hidden.device) if merged and not vocab else None
        ldt = logits_dtype_for(hidden, opts)
        chunk = chunk_rows_for(hidden, weight, shard, ldt, log_prob_tiles=vocab,
                               per_logit=truncation.per_logit(truncated, ldt, hidden.dtype,
                                                              opts, V, shard))
        run_chunks(hidden, weight, bias, row_fn, () if vocab else (parts or out),
                   (False,) * 3, "fp32", chunk, by_vocab=vocab, logits_dtype=ldt,
                   triton=backend.sums)
    if merged:
        stats = _joined(blocks) if vocab else parts
        out = finish_stats(all_reduce_tile_stats(stats, shard) if shard.group else stats,
                           target, V, opts.ignore_index, opts.entropy)
    logprob, ent, lse, argmax, row_stats = out
    return (logprob, ent if opts.entropy else hidden.new_empty(0, dtype=mdt), lse, argmax,
            row_stats)


@kernel("linear_logprobs_bwd", hidden=3)
def bwd(grad_logprob, grad_entropy, row_stats, hidden, weight, target, bias, temperature,
         *args, backend):
    """Recomputes the logits chunk by chunk (vocabulary tiles when there are fewer
    tokens than classes: the float32 sum it keeps is then N x D; _cuts_vocab says why
    they are the forward's logits bit for bit) and, with the forward's row statistics,
    forms the logits gradient in one pass over them (a truncation: its rows' gradient,
    the kept set from the forward's threshold)."""
    opts, rest = take(LogProbOptions, args)
    shard, (needs,) = take(VocabShard, rest)
    V = shard.vocab(weight)
    truncated = truncation_rows(backend, opts, shard, V)
    grad = logprob_rows(backend).grad if truncated is None else truncated.grad
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    inv_t = after_first_gemm(lambda: inverse_temperature(temperature, N, hidden.device, mdt))
    per_token = after_first_gemm(lambda: [None if t is None else t.to(mdt)
                                          for t in (grad_logprob, grad_entropy, row_stats)])
    vocab = _cuts_vocab(hidden, weight, opts)[1]
    start = shard.vocab_start

    def row_fn(logits, s, e, r0=0, r1=None):
        if vocab:  # classes [s, e) of tokens [r0, r1)
            return (), grad(logits, target[r0:r1], inv_t()[r0:r1], opts,
                            *(None if t is None else t[r0:r1] for t in per_token()), mdt,
                            start + s, hidden.dtype)
        g_lp, g_h, stats = (None if t is None else t[s:e] for t in per_token())
        return (), grad(logits, target[s:e], inv_t()[s:e], opts, g_lp, g_h, stats, mdt, start,
                        hidden.dtype)

    ldt = logits_dtype_for(hidden, opts)  # the forward's: the same logits, bit for bit
    chunk = chunk_rows_for(hidden, weight, shard, ldt, log_prob_tiles=vocab,
                           per_logit=truncation.per_logit(truncated, ldt, hidden.dtype, opts,
                                                          V, shard))
    with no_autocast(hidden):
        gradients = run_chunks(hidden, weight, bias, row_fn, (), needs, opts.accumulator,
                               chunk, by_vocab=vocab, shard=shard, logits_dtype=ldt,
                               triton=backend.sums)
    return grad_outputs(hidden, weight, bias, gradients, keep_f32=False)


def _joined(blocks):
    """The TileStats of all tokens from those of their blocks, made in the tokens'
    order by the first tile (the loop runs at least one, also for no tokens)."""
    if len(blocks) == 1:
        return blocks[0]
    return TileStats(*(torch.cat(fields) for fields in zip(*blocks.values())))


def _cuts_vocab(hidden, weight, opts):
    """(forward, backward): whether each cuts vocabulary tiles. The backward does with
    fewer tokens than classes (its float32 sum is then N x D), where it recomputes the
    forward's logits; a truncation's threshold test needs them to the bit. The forward
    cuts token chunks whatever N (batch invariance) on the CPU (fixed GEMM units: a tile
    has the whole product's bits) and for bf16 inputs on CUDA, where cuBLAS gives a tile
    the whole product's bits only at widths of whole 128-class GEMM tiles (measured; at
    an odd width every tile rounds apart, docs/numerics.md): there a truncation's
    backward cuts the forward's token chunks, an untruncated one tiles anyway (a logit a
    rounding apart moves its p as little: as exact against float64, measured). Other
    inputs on CUDA cut as the backward (the same tiles: the same GEMMs), but a
    truncation needs whole rows there, so both cut token chunks."""
    tiles = by_vocab(hidden.shape[0], weight.shape[0])
    if hidden.device.type != "cuda":
        return False, tiles
    truncates = truncation.truncating(opts)
    if hidden.dtype == torch.bfloat16:
        return False, tiles and not (truncates and weight.shape[0] % GEMM_TILE)
    if truncates:
        return False, False
    return tiles, tiles

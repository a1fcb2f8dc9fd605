"""The token-chunked loop shared by every backend.

Per chunk of n tokens: logits = hidden @ weight.T + bias (one GEMM into an (n, V)
buffer), a row function turns them into per-token terms and, when gradients are
wanted, the logits gradient dz, then dz @ weight gives the hidden gradient and dz.T @
hidden is added to the weight gradient. Memory beyond inputs and outputs is the (n, V)
chunk plus the gradient accumulator (and, for float32 master weights, the weight in
hidden's dtype for the GEMMs); n is chosen per backend from a fixed budget.
Backends differ only in the row function and the chunk size. Cross entropy
(rows.py, triton/rows.py) and the log-probs (logprob_rows.py, triton/logprob_rows.py)
are two row functions on the same loop.

The log-probs, whose backward has its row statistics from the forward, cut the same
workspace along the vocabulary instead when there are fewer tokens than classes: the
forward merges each tile's statistics per row (logprob_rows.TileStats); the
backward re-reads a float32 sum of the hidden gradient (N x D) across tiles where token
chunks re-read the weight gradient's (V x D), and each tile's weight gradient comes
whole out of one GEMM over all tokens.
"""

import contextlib

import torch
import torch.nn.functional as F

from . import policy
from .accumulate import GradAccumulator, _mm_f32
from .logprob_rows import empty_tile_stats, finish_stats
from .rows import RowOptions
from .tokens import grad_scales, reduce_loss


def math_dtype_for(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_chunks(hidden, weight, bias, row_fn, outputs, needs_grad, accumulator, chunk_rows,
               by_vocab=False):
    """The loop. row_fn(logits, s, e) -> (terms, dz) for the chunk of tokens [s, e):
    per-token terms written into the (N,) buffers of `outputs`, and the logits gradient
    dz (None when no gradient is wanted). Returns (grad_hidden, grad_weight, grad_bias),
    each None unless flagged in needs_grad; grad_weight/grad_bias in the accumulator's
    dtype.

    With by_vocab, the same workspace of chunk_rows x V logits is cut along the
    vocabulary: row_fn(logits, v0, v1) gets every token's logits of classes [v0, v1)
    and returns ((), dz) (it keeps its own per-token results); the hidden gradient is
    summed in the math dtype, the weight and bias gradients come in their output
    dtypes."""
    if by_vocab:
        return _run_vocab_tiles(hidden, weight, bias, row_fn, needs_grad, chunk_rows)
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = hidden.dtype
    mdt = math_dtype_for(dtype)
    w = weight.to(dtype)  # products run in hidden's dtype (master weights: as autocast)
    b = None if bias is None else bias.to(dtype)
    gh = hidden.new_empty(hidden.shape) if needs_grad[0] else None
    gw = GradAccumulator(accumulator, (V, D), dtype, weight.dtype, hidden.device) \
        if needs_grad[1] else None
    gb = hidden.new_zeros(V, dtype=mdt) if needs_grad[2] else None
    for s in range(0, N, chunk_rows):
        e = min(N, s + chunk_rows)
        h = hidden[s:e]
        terms, dz = row_fn(F.linear(h, w, b), s, e)
        for out, term in zip(outputs, terms):
            out[s:e] = term
        if gh is not None:
            torch.mm(dz, w, out=gh[s:e])
        if gw is not None:
            gw.add(dz, h)
        if gb is not None:
            gb += dz.sum(0, dtype=mdt)
        del terms, dz  # freed before the next chunk is allocated: one chunk at a time
    return gh, gw, gb


def _run_vocab_tiles(hidden, weight, bias, row_fn, needs_grad, chunk_rows):
    N, D = hidden.shape
    V = weight.shape[0]
    dtype = hidden.dtype
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    cols = max(1, chunk_rows * V // max(1, N))
    cols = cols // 128 * 128 if cols >= 128 else cols  # whole GEMM tiles, as token chunks
    # The hidden gradient is a sum across tiles: float32 (float64 for float64 inputs).
    gh = GradAccumulator("fp32", (N, D), dtype, dtype, hidden.device) \
        if needs_grad[0] else None
    gw = torch.empty(V, D, dtype=grad_dtype(weight.dtype, False), device=hidden.device) \
        if needs_grad[1] else None
    gb = torch.empty(V, dtype=grad_dtype(bias.dtype, False), device=hidden.device) \
        if needs_grad[2] else None
    for v0 in range(0, V, cols):
        v1 = min(V, v0 + cols)
        _, dz = row_fn(F.linear(hidden, w[v0:v1], None if b is None else b[v0:v1]), v0, v1)
        if gh is not None:
            gh.add(dz.t(), w[v0:v1])
        if gw is not None:
            _mm_f32(dz.t(), hidden, out=gw[v0:v1])
        if gb is not None:
            gb[v0:v1] = dz.sum(0, dtype=math_dtype_for(dtype))
        del dz
    return gh, gw, gb


def by_vocab(N, V):
    """Whether the log-probs (forward and backward alike) cut their workspace along the
    vocabulary: when there are fewer tokens than classes (the float32 sum the backward
    re-reads per tile, N x D, is then the smaller one)."""
    return N < V


def after_first_gemm(make):
    """make(), formed on first use from a row function: once the loop has queued its
    first logits GEMM, so the GPU runs it while the host queues make()'s small kernels
    (before it, the GPU would wait on the host for each)."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]
    return get


def autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta): nothing to cast
        return False


def _no_autocast(hidden):
    """The loop's products in the inputs' dtypes under a caller's autocast too (the
    context is entered only then: it costs the host more than the check)."""
    device = hidden.device.type
    return torch.autocast(device, enabled=False) if autocast_enabled(device) \
        else contextlib.nullcontext()


def _ce_chunks(hidden, weight, target, bias, class_weight, opts, needs_grad, scales, rows,
               chunk_rows, accumulator):
    """Cross entropy on the loop: (lse, nll, smooth) each (N,), plus argmax (N,) int64
    when opts.argmax, and the gradients; scales() gives (ce_scale, z_scale), or scales
    is None without gradients."""
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    terms = tuple(hidden.new_empty(N, dtype=mdt) for _ in range(3)) + (
        (hidden.new_empty(N, dtype=torch.int64),) if opts.argmax else ())

    def row_fn(logits, s, e):
        ce_z = (None, None) if scales is None else (t[s:e] for t in scales())
        *out, argmax, dz = rows(logits, target[s:e], class_weight, *ce_z, opts, mdt)
        return out + ([argmax] if opts.argmax else []), dz

    grads = run_chunks(hidden, weight, bias, row_fn, terms, needs_grad, accumulator,
                       chunk_rows)
    return terms, grads


def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                  label_smoothing, softcap, z_loss, accumulator, needs_grad, stats, *, rows,
                  chunk_rows):
    """fce::linear_ce_fwd on one device, given its row function and chunk size."""
    opts = RowOptions(ignore_index, label_smoothing, softcap, argmax=stats)
    scales = after_first_gemm(lambda: grad_scales(
        target, class_weight, ignore_index, reduction, z_loss, math_dtype_for(hidden.dtype))
    ) if any(needs_grad) else None
    with _no_autocast(hidden):
        (lse, nll, smooth, *argmax), grads = _ce_chunks(
            hidden, weight, target, bias, class_weight, opts, needs_grad, scales, rows,
            chunk_rows, accumulator)
        loss = reduce_loss(nll, smooth, lse, target, class_weight, ignore_index, reduction,
                           label_smoothing, z_loss, weight.shape[0])
    none = hidden.new_empty(0, dtype=lse.dtype), hidden.new_empty(0, dtype=torch.int64)
    return (loss, *_grad_outputs(hidden, weight, bias, grads, accumulator == "fp32"),
            *((lse, argmax[0]) if stats else none))


def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, ignore_index,
                  reduction, label_smoothing, softcap, z_loss, accumulator, needs_grad, *,
                  rows, chunk_rows):
    """fce::linear_ce_bwd on one device: recomputes the logits chunk by chunk."""
    mdt = math_dtype_for(hidden.dtype)
    opts = RowOptions(ignore_index, label_smoothing, softcap)
    scales = after_first_gemm(lambda: grad_scales(
        target, class_weight, ignore_index, reduction, z_loss, mdt, grad_loss=grad_loss))
    with _no_autocast(hidden):
        _, grads = _ce_chunks(hidden, weight, target, bias, class_weight, opts, needs_grad,
                              scales, rows, chunk_rows, accumulator)
    return _grad_outputs(hidden, weight, bias, grads, keep_f32=False)


def linear_logprobs_fwd(hidden, weight, target, bias, temperature, softcap, ignore_index,
                        entropy, *, rows, chunk_rows):
    """fce::linear_logprobs_fwd on one device: (logprob, entropy, lse, argmax), each (N,),
    and row_stats (N, 3); entropy is (0,) unless asked for."""
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    V = weight.shape[0]
    inv_t = after_first_gemm(lambda: inverse_temperature(temperature, N, hidden.device, mdt))
    opts = RowOptions(ignore_index, 0.0, softcap)
    out = [hidden.new_empty(N, dtype=mdt) for _ in range(3)] + [
        hidden.new_empty(N, dtype=torch.int64), hidden.new_empty(N, 3, dtype=mdt)]
    # Cut as the backward will: it recomputes the same GEMMs, so its logits are the
    # forward's bit for bit, and z - m is exact at each row's max.
    vocab = by_vocab(N, V)
    total = after_first_gemm(lambda: empty_tile_stats(N, mdt, hidden.device))

    def row_fn(logits, s, e):
        if vocab:  # classes [s, e) of every token
            rows(logits, target, inv_t(), opts, entropy, None, mdt, col0=s, into=total())
            return (), None
        *terms, _ = rows(logits, target[s:e], inv_t()[s:e], opts, entropy, None, mdt)
        return terms, None

    with _no_autocast(hidden):
        run_chunks(hidden, weight, bias, row_fn, () if vocab else out, (False,) * 3, "fp32",
                   chunk_rows, by_vocab=vocab)
    if vocab:
        out = finish_stats(total(), target, V, ignore_index, entropy)
    logprob, ent, lse, argmax, row_stats = out
    return (logprob, ent if entropy else hidden.new_empty(0, dtype=mdt), lse, argmax,
            row_stats)


def linear_logprobs_bwd(grad_logprob, grad_entropy, row_stats, hidden, weight, target,
                        bias, temperature, softcap, ignore_index, accumulator, needs_grad, *,
                        rows, chunk_rows):
    """fce::linear_logprobs_bwd on one device: recomputes the logits chunk by chunk and,
    with the forward's row statistics, forms the logits gradient in one pass over them."""
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    inv_t = after_first_gemm(lambda: inverse_temperature(temperature, N, hidden.device, mdt))
    opts = RowOptions(ignore_index, 0.0, softcap)
    per_token = after_first_gemm(lambda: [None if t is None else t.to(mdt)
                                          for t in (grad_logprob, grad_entropy, row_stats)])
    vocab = by_vocab(N, weight.shape[0])

    def row_fn(logits, s, e):
        if vocab:  # classes [s, e) of every token
            *_, dz = rows(logits, target, inv_t(), opts, False, per_token(), mdt, col0=s)
            return (), dz
        grad = tuple(None if t is None else t[s:e] for t in per_token())
        *_, dz = rows(logits, target[s:e], inv_t()[s:e], opts, False, grad, mdt)
        return (), dz

    with _no_autocast(hidden):
        grads = run_chunks(hidden, weight, bias, row_fn, (), needs_grad, accumulator,
                           chunk_rows, by_vocab=vocab)
    return _grad_outputs(hidden, weight, bias, grads, keep_f32=False)


# Where ignore_index sits among fce::linear_policy_loss_fwd's arguments after temperature.
POLICY_IGNORE_INDEX = 11


def linear_policy_loss_fwd(hidden, weight, target, advantages, bias, old_logprobs,
                           ref_logprobs, token_weights, temperature, loss_type, epsilon_low,
                           epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg,
                           beta, kl, kl_ratio, entropy_coef, softcap, ignore_index,
                           accumulator, needs_grad, *, rows, chunk_rows):
    """fce::linear_policy_loss_fwd on one device: (loss, grad_hidden, grad_weight,
    grad_bias, logprob, entropy, ratio, clipped, kl). Per chunk the row function forms
    the log-probs and entropies, policy.policy_terms their loss terms and upstream
    gradients, and the row function the logits gradient from the same chunk: the
    gradients come with the forward's GEMM and the two gradient GEMMs."""
    opts = policy.check_policy_options(loss_type, epsilon_low, epsilon_high, delta,
                                       sapo_temperature_pos, sapo_temperature_neg, beta, kl,
                                       kl_ratio, entropy_coef)
    N, mdt = hidden.shape[0], math_dtype_for(hidden.dtype)
    row_opts = RowOptions(ignore_index, 0.0, softcap)
    out = [hidden.new_empty(N, dtype=mdt) for _ in range(6)]  # loss_t, logprob, ... kl
    want = any(needs_grad)

    @after_first_gemm
    def per_token():  # 1 / T, whether counted, w_t
        valid = target != ignore_index
        return (inverse_temperature(temperature, N, hidden.device, mdt), valid,
                policy.token_weights(token_weights, valid, mdt))

    def row_fn(logits, s, e):
        inv_t, valid, weights = per_token()
        terms = []

        def upstream(logprob, entropy):
            terms.extend(policy.policy_terms(
                logprob, entropy, valid[s:e], advantages[s:e],
                None if old_logprobs is None else old_logprobs[s:e],
                None if ref_logprobs is None else ref_logprobs[s:e], weights[s:e], opts))
            return terms[1], terms[2] if opts.entropy_coef != 0.0 else None

        lp, ent, *_, dz = rows(logits, target[s:e], inv_t[s:e], row_opts, True,
                               upstream if want else None, mdt)
        if not want:
            upstream(lp, ent)
        loss_t, _, _, ratio, clipped, kl = terms
        return (loss_t, lp, ent, ratio, clipped, kl), dz

    with _no_autocast(hidden):
        grads = run_chunks(hidden, weight, bias, row_fn, out, needs_grad, accumulator,
                           chunk_rows)
    loss_t, *stats = out
    return (loss_t.sum(), *_grad_outputs(hidden, weight, bias, grads, accumulator == "fp32"),
            *stats)


def inverse_temperature(temperature, N, device, dtype):
    """1 / temperature per token, NaN where it is not > 0 (no host check off the CPU)."""
    if temperature is None:
        return torch.ones(N, device=device, dtype=dtype)
    t = temperature.to(dtype)
    return torch.where(t > 0, 1.0 / t, float("nan"))


def grad_dtype(dtype, keep_f32):
    """Output dtype of a weight/bias gradient: float32 sums are kept for the backward."""
    return torch.promote_types(dtype, torch.float32) if keep_f32 else dtype


def _grad_outputs(hidden, weight, bias, grads, keep_f32):
    """Casts gradients to their output dtypes; (0,) placeholders for those not wanted."""
    gh, gw, gb = grads
    if isinstance(gh, GradAccumulator):  # summed across vocabulary tiles
        gh = gh.result(hidden.dtype)
    if isinstance(gw, GradAccumulator):  # summed across token chunks
        gw = gw.result(grad_dtype(weight.dtype, keep_f32))
    return (
        hidden.new_empty(0) if gh is None else gh,
        hidden.new_empty(0) if gw is None else gw,
        hidden.new_empty(0) if gb is None else gb.to(grad_dtype(bias.dtype, keep_f32)),
    )

"""The token-chunked loop shared by every op, backend and vocabulary layout.

Per chunk of n tokens: logits = hidden @ weight.T + bias (one GEMM into an (n, V)
buffer: rounded to the inputs' dtype as F.linear does, or with the option logits_dtype
= torch.float32 the GEMM's float32 sums themselves), a row function turns them into
per-token terms and, when gradients are wanted, the logits gradient dz, then dz @
weight gives the hidden gradient and dz.T @ hidden is added to the weight gradient.
Memory beyond inputs and outputs is the (n, V) chunk plus the gradient accumulator
(and, for float32 master weights, the weight in hidden's dtype for the GEMMs); n comes
from the workspace (workspace.py).

Row functions (the `RowFn` protocol below) are each op's math; the backends differ
only in which row functions they bring (machinery/dispatch.py). A row function whose
logits gradient has a few entries a row gives it as a sparse.SparseGrad (sparse=True):
the loop then runs no gradient GEMM and forms the gradients from the entries at the end
(sparse.py). Two layouts ride the same loop:
- vocabulary tiles (`by_vocab`): the log-probs with fewer tokens than classes cut the
  same workspace along the vocabulary; row functions then see the logits of classes
  [v0, v1) of every token (of a block of tokens, where all of them would not fit the
  workspace) and merge per-row statistics across tiles; the hidden gradient is a
  float32 sum across tiles;
- vocabulary shards (`VocabShard`, vocab-parallel): each rank holds rows [vocab_start,
  vocab_start + Vs) of the head. The row functions reduce their shard's logits to
  per-row statistics and `VocabShard.all_reduce` (the collective hook) makes them global
  before any gradient is formed; the hidden gradient's float32 partial sums are
  all-reduced once at the end, the weight and bias gradients stay local.
"""

import contextlib
from typing import NamedTuple, Optional, Protocol

import torch
import torch.nn.functional as F

from ..contract.entry import autocast_enabled
from .accumulate import GradAccumulator, _mm_f32
from .sparse import SparseGrad, products as sparse_products
from .workspace import chunk_rows as _workspace_rows


class RowFn(Protocol):
    """row_fn(logits, s, e) -> (terms, dz): logits is the loop's (n, cols) buffer,
    which the row function may overwrite (dz is written over it where it can; dz is in
    hidden's dtype, the gradient GEMMs' operand, also when the logits are wider). With
    token chunks, [s, e) are the chunk's tokens and terms the per-token results, each
    written into the loop's (N,) `outputs`; with vocabulary tiles, row_fn(logits, s, e,
    r0, r1): [s, e) are the tile's classes, [r0, r1) its tokens (all of them where they
    fit the workspace) and terms is () (the row function keeps its own per-row
    statistics). dz is None when no gradient is wanted, and a sparse.SparseGrad in a
    loop run with sparse=True."""

    def __call__(self, logits: torch.Tensor, s: int, e: int, *rows: int) -> tuple: ...


class VocabShard(NamedTuple):
    """Where this rank's classes sit in the vocabulary: rows [vocab_start, vocab_start +
    weight.shape[0]) of a head of vocab_size classes, across the process group named
    `group` of world_size ranks. `VocabShard()` is one device (the whole vocabulary on this
    rank)."""
    group: Optional[str] = None
    vocab_start: int = 0
    vocab_size: int = -1
    world_size: int = 1

    def vocab(self, weight):
        """The whole vocabulary's size V."""
        return weight.shape[0] if self.group is None else self.vocab_size

    def all_reduce(self, t, op):
        """The collective hook: t reduced ("sum", "max", "min") across the group; t
        itself on one device."""
        if self.group is None:
            return t
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_reduce(t, op, self.group)
        # the op's kernels run eagerly: wait for the collective here
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out

    def all_gather(self, t):
        """Every rank's t, concatenated along dim 0 in rank order; t itself on one
        device."""
        if self.group is None:
            return t
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_gather_tensor(t.contiguous(), 0, self.group)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


ONE_DEVICE = VocabShard()


def math_dtype_for(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def logits_dtype_for(hidden, opts):
    """The dtype of the loop's logits: hidden's, or float32 for low-precision inputs
    whose options ask for float32 logits (opts.logits_dtype; float64 inputs keep
    float64)."""
    if opts.logits_dtype is None:
        return hidden.dtype
    return torch.promote_types(hidden.dtype, opts.logits_dtype)


def chunk_rows_for(hidden, weight, shard=ONE_DEVICE, logits_dtype=None, log_prob_tiles=None,
                   per_logit=None, scale=1.0, weight_grad=True):
    """Token rows per chunk (logits_dtype: the loop's, when wider than hidden's: the
    chunk then holds those logits and a dz of hidden's dtype beside them). Every rank
    of a shard group must cut the same chunks (each chunk's statistics are
    all-reduced), so a shard's size comes from V / world size, not from this rank's
    rows: with uneven shards a larger shard's chunk exceeds the workspace by its share
    over V / world size. log_prob_tiles: None for the cross-entropy; for the log-prob
    family whether it cuts vocabulary tiles (its default is then bounded by the float32
    sums it keeps, see workspace). per_logit: the chunk's bytes per logit where the row
    function holds more than the logits and dz (the distillation family's, RowMath's);
    scale: the op's CUDA default workspace as a multiple of the loop's; weight_grad=False:
    an op without a weight gradient (workspace.chunk_rows)."""
    V = weight.shape[0] if shard.group is None else -(-shard.vocab_size // shard.world_size)
    N, D = hidden.shape
    if per_logit is None and logits_dtype is not None:
        per_logit = logits_bytes(logits_dtype, hidden.dtype)
    held = None
    if log_prob_tiles is not None:  # float32 sums beyond the gradient of their shape
        held = (N if log_prob_tiles else V) * D * (4 - min(4, hidden.dtype.itemsize))
    return _workspace_rows(N, max(1, V), D, hidden.dtype, hidden.device, per_logit, held,
                           scale, weight_grad)


def logits_bytes(logits_dtype, dz_dtype):
    """A chunk's bytes per logit for the logits and their gradient dz: dz is written
    over logits of its dtype, and has a buffer of its own beside wider ones."""
    return logits_dtype.itemsize + (dz_dtype.itemsize if logits_dtype != dz_dtype else 0)


def run_chunks(hidden, weight, bias, row_fn, outputs, needs_grad, accumulator, chunk_rows,
               by_vocab=False, shard=ONE_DEVICE, logits_dtype=None, sparse=False,
               triton=False):
    """The loop: row_fn (a RowFn) per chunk of chunk_rows tokens (by_vocab: per tile
    of as many logits, along the vocabulary), the logits in logits_dtype (None:
    hidden's; see logits_dtype_for); sparse: row_fn gives SparseGrads (token chunks);
    triton: the loop's own sums run their Triton kernels (the Kahan sums, a sparse
    gradient's products), as the op's rows do (its Backend's flag).
    Returns (grad_hidden, grad_weight, grad_bias), each None unless flagged in
    needs_grad; grad_weight a GradAccumulator (token chunks) or a tensor in its output
    dtype (tiles, sparse); grad_hidden in hidden's dtype on one device with token
    chunks, else a float32 sum (the tiles' or the shards'), all-reduced across a shard
    group."""
    gemm = LogitsGemm(hidden, weight, bias, logits_dtype or hidden.dtype)
    if by_vocab:
        gh, gw, gb = _run_vocab_tiles(hidden, weight, bias, row_fn, needs_grad, chunk_rows,
                                      gemm)
    else:
        gh, gw, gb = _run_token_chunks(hidden, weight, row_fn, outputs, needs_grad,
                                       accumulator, chunk_rows, shard, gemm, sparse, triton)
    if gh is not None and shard.group is not None:
        gh = shard.all_reduce(gh.result(math_dtype_for(hidden.dtype))
                              if isinstance(gh, GradAccumulator) else gh, "sum")
    return gh, gw, gb


# Off CUDA the logits GEMMs run in units of this many rows and classes (batch
# invariance; multiples of the CPU kernels' blocking: measured +7% (bf16) / +17%
# (float32 logits) at 4096 x 1024 x 32000 on a 2-core CPU against one GEMM).
UNIT_ROWS, UNIT_COLS = 256, 4096
# On CUDA, chunks of fewer rows run zero-padded to this many (a one-row float32-logit
# product took another kernel, with other rounding: docs/numerics.md)
CUDA_MIN_ROWS = 128
# The classes of a CUDA logits GEMM tile: a vocabulary tile's width is a whole number of
# them (cuBLAS then rounds a tile as the whole product, at a width that is one too:
# docs/numerics.md)
GEMM_TILE = 128


class LogitsGemm:
    """The chunks' logits GEMM. Products run in hidden's dtype (master weights rounded
    to it, as autocast does); the logits are rounded to it as F.linear's (the bias
    rounded to it first, as TRL's log-prob head adds it), or kept as the GEMM's float32
    sums (a wider `dtype`) with the bias added at that width (a float32 bias unrounded,
    as TRL's divergence adds it)."""

    def __init__(self, hidden, weight, bias, dtype):
        self.dtype = dtype
        self.w = weight.to(hidden.dtype)  # also the gradient GEMMs' operand
        self.wide = dtype != hidden.dtype
        self.b = None if bias is None else bias.to(dtype if self.wide else hidden.dtype)
        # Off CUDA no GEMM writes float32 sums of low-precision operands: it multiplies
        # their exact float32 upcasts instead (the weight's made once per call).
        self.w_wide = self.w.to(dtype) if self.wide and hidden.device.type != "cuda" \
            else None

    def __call__(self, h, v0=0, v1=None):
        """Logits of tokens h against the classes [v0, v1). On CUDA one GEMM (cuBLAS's
        rows do not depend on the row count: measured for bf16, docs/numerics.md);
        elsewhere GEMMs of one fixed shape, UNIT_ROWS zero-padded rows by the classes of
        one UNIT_COLS block at a fixed offset, whose rows' bits then do not depend on
        the batch."""
        v1 = self.w.shape[0] if v1 is None else v1
        if h.device.type == "cuda":
            if h.shape[0] >= CUDA_MIN_ROWS:
                return self._gemm(h, v0, v1)
            # a GEMV-like kernel for a few rows rounds otherwise (measured on the H200:
            # one float32-logit row of 64 x 33001 differs): the few rows zero-padded
            stage = h.new_zeros(CUDA_MIN_ROWS, h.shape[1])
            stage[:h.shape[0]] = h
            return self._gemm(stage, v0, v1)[:h.shape[0]]
        out = torch.empty(h.shape[0], v1 - v0, dtype=self.dtype, device=h.device)
        stage = h.new_zeros(UNIT_ROWS, h.shape[1])
        V = self.w.shape[0]
        for r in range(0, h.shape[0], UNIT_ROWS):
            n = min(UNIT_ROWS, h.shape[0] - r)
            stage[:n] = h[r:r + n]
            stage[n:] = 0
            for c in range(v0 - v0 % UNIT_COLS, v1, UNIT_COLS):
                z = self._gemm(stage, c, min(V, c + UNIT_COLS))
                a, b = max(c, v0), min(v1, c + UNIT_COLS)  # the unit's classes wanted
                out[r:r + n, a - v0:b - v0] = z[:n, a - c:b - c]
        return out

    def _gemm(self, h, v0, v1):
        w = self.w[v0:v1]
        b = None if self.b is None else self.b[v0:v1]
        if not self.wide:
            return F.linear(h, w, b)
        if self.w_wide is None:
            z = torch.mm(h, w.t(), out_dtype=self.dtype)
        else:
            z = torch.mm(h.to(self.dtype), self.w_wide[v0:v1].t())
        return z if b is None else z.add_(b)


def _run_token_chunks(hidden, weight, row_fn, outputs, needs_grad, accumulator,
                      chunk_rows, shard, gemm, sparse, triton):
    N, D = hidden.shape
    dtype = hidden.dtype
    mdt = math_dtype_for(dtype)
    w = gemm.w
    # A shard's hidden gradient is a partial sum across ranks: float32 until all-reduced.
    partial = shard.group is not None and dtype != mdt
    gh = hidden.new_empty(hidden.shape, dtype=mdt if partial else dtype) \
        if needs_grad[0] else None
    entries = []  # sparse: the chunks' SparseGrads
    gw = GradAccumulator(accumulator, weight.shape, dtype, weight.dtype, hidden.device,
                         triton) if needs_grad[1] and not sparse else None
    gb = hidden.new_zeros(weight.shape[0], dtype=mdt) \
        if needs_grad[2] and not sparse else None
    for s in range(0, N, chunk_rows):
        e = min(N, s + chunk_rows)
        h = hidden[s:e]
        terms, dz = row_fn(gemm(h), s, e)
        for out, term in zip(outputs, terms):
            out[s:e] = term
        if sparse:
            entries.append(dz)
        elif gh is not None:
            if partial:
                _mm_f32(dz, w, out=gh[s:e])
            else:
                torch.mm(dz, w, out=gh[s:e])
        if gw is not None:
            gw.add(dz, h)
        if gb is not None:
            gb += dz.sum(0, dtype=mdt)
        del terms, dz  # freed before the next chunk is allocated: one chunk at a time
    if sparse and any(needs_grad):
        grad = SparseGrad(*map(torch.cat, zip(*entries))) if entries else SparseGrad(
            hidden.new_zeros(0, 1, dtype=torch.long), hidden.new_zeros(0, 1, dtype=mdt))
        return sparse_products(grad, hidden, w, needs_grad, gh,
                               grad_dtype(weight.dtype, accumulator == "fp32"), triton)
    return gh, gw, gb


def vocab_tiles(N, V, chunk_rows, cuda):
    """(rows, cols) of the vocabulary tiles that hold the workspace's chunk_rows x V
    logits: every token's logits of cols classes, in whole GEMM tiles (off CUDA, whole
    units of the logits GEMM); where the smallest such tile of all N tokens would not
    fit, blocks of rows (whole units too) cut it, down to one unit (UNIT_ROWS x
    UNIT_COLS off CUDA, 128 x GEMM_TILE on CUDA: the workspace's floor)."""
    cols = max(1, chunk_rows * V // max(1, N))
    if cols >= GEMM_TILE or cuda:  # tiles of even width (no thin last one), in whole
        # GEMM tiles (on CUDA at least one: cuBLAS gives a tile the whole product's bits
        # only at such widths)
        cols = -(-V // -(-V // cols))
        cols = -(-cols // GEMM_TILE) * GEMM_TILE
    unit = CUDA_MIN_ROWS if cuda else UNIT_ROWS
    if not cuda:  # off CUDA: whole units of the logits GEMM
        cols = -(-cols // UNIT_COLS) * UNIT_COLS
    cols = min(cols, max(1, V))
    if N * cols <= chunk_rows * V:
        return max(1, N), cols
    return max(unit, chunk_rows * V // cols // unit * unit), cols


def _run_vocab_tiles(hidden, weight, bias, row_fn, needs_grad, chunk_rows, gemm):
    N, D = hidden.shape
    V = weight.shape[0]
    dtype, mdt = hidden.dtype, math_dtype_for(hidden.dtype)
    w = gemm.w
    rows, cols = vocab_tiles(N, V, chunk_rows, hidden.device.type == "cuda")
    whole = rows >= N  # every token in each tile: its gradients written, not summed
    # The hidden gradient is a sum across tiles: float32 (float64 for float64 inputs).
    gh = GradAccumulator("fp32", (N, D), dtype, dtype, hidden.device) \
        if needs_grad[0] else None
    gw = torch.empty(V, D, dtype=grad_dtype(weight.dtype, False), device=hidden.device) \
        if needs_grad[1] else None
    gb = torch.empty(V, dtype=grad_dtype(bias.dtype, False), device=hidden.device) \
        if needs_grad[2] else None
    for v0 in range(0, V, cols):
        v1 = min(V, v0 + cols)
        # blocks of tokens: the tile's weight and bias gradients summed in float32
        gw_tile = None if whole or gw is None else \
            GradAccumulator("fp32", (v1 - v0, D), dtype, torch.float32, hidden.device)
        gb_tile = None if whole or gb is None else hidden.new_zeros(v1 - v0, dtype=mdt)
        for r0 in range(0, max(N, 1), rows):  # no tokens: one empty block (zero gradients)
            r1 = min(N, r0 + rows)
            h = hidden[r0:r1]
            _, dz = row_fn(gemm(h, v0, v1), v0, v1, r0, r1)
            if gh is not None:
                gh.add(dz.t(), w[v0:v1], rows=None if whole else slice(r0, r1))
            if gw_tile is not None:
                gw_tile.add(dz, h)
            elif gw is not None:
                _mm_f32(dz.t(), h, out=gw[v0:v1])
            if gb_tile is not None:
                gb_tile += dz.sum(0, dtype=mdt)
            elif gb is not None:
                gb[v0:v1] = dz.sum(0, dtype=mdt)
            del dz
        if gw_tile is not None:
            gw[v0:v1] = gw_tile.result(gw.dtype)
        if gb_tile is not None:
            gb[v0:v1] = gb_tile
    return gh, gw, gb


def by_vocab(N, V):
    """Whether the log-probs (forward and backward alike) cut their workspace along the
    vocabulary: when there are fewer tokens than classes (the float32 sum the backward
    re-reads per tile, N x D, is then the smaller one). V is this rank's classes."""
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


def no_autocast(hidden):
    """The loop's products in the inputs' dtypes under a caller's autocast too (the
    context is entered only then: it costs the host more than the check)."""
    device = hidden.device.type
    return torch.autocast(device, enabled=False) if autocast_enabled(device) \
        else contextlib.nullcontext()


def inverse_temperature(temperature, N, device, dtype):
    """1 / temperature per token, NaN where it is not > 0 (no host check off the CPU)."""
    if temperature is None:
        return torch.ones(N, device=device, dtype=dtype)
    t = temperature.to(dtype)
    return torch.where(t > 0, 1.0 / t, float("nan"))


def grad_dtype(dtype, keep_f32):
    """Output dtype of a weight/bias gradient: float32 sums are kept for the backward."""
    return torch.promote_types(dtype, torch.float32) if keep_f32 else dtype


def grad_outputs(hidden, weight, bias, grads, keep_f32, hidden_f32=False):
    """Casts gradients to their output dtypes; (0,) placeholders for those not wanted.
    hidden_f32: the hidden gradient stays a float32 sum (a shard group's all-reduced
    partials, kept for the backward's one rounding)."""
    gh, gw, gb = grads
    if isinstance(gh, GradAccumulator):  # summed across vocabulary tiles
        gh = gh.result(hidden.dtype)
    if isinstance(gw, GradAccumulator):  # summed across token chunks
        gw = gw.result(grad_dtype(weight.dtype, keep_f32))
    return (
        hidden.new_empty(0) if gh is None else gh.to(grad_dtype(hidden.dtype, hidden_f32)),
        hidden.new_empty(0) if gw is None else gw,
        hidden.new_empty(0) if gb is None else gb.to(grad_dtype(bias.dtype, keep_f32)),
    )

"""The gradients of a loss whose logits gradient has a few entries per row.

A row function may give a chunk's logits gradient as a `SparseGrad` (n, K): the value
of d loss / d z at K columns of each row, 0 at every other class (the sparse divergence
renormalised over a teacher's top-k: its loss reads only the support's logits). The loop
(chunked.run_chunks with sparse=True) then runs no gradient GEMM: it keeps the chunks'
(n, K) entries and forms, once at the end,
  hidden gradient  gh[t] = sum_k vals[t, k] W[cols[t, k]]       (K rows of W a token)
  weight gradient  gw[c] = sum over entries naming c of vals * hidden[token]
  bias gradient    gb[c] = sum over entries naming c of vals
each a float32 sum (float64 for float64 inputs) rounded once into its output, in a fixed
order: no atomics, identical calls give identical bits. On CUDA two Triton kernels (the
entries sorted by class, each class's row summed by one program); elsewhere PyTorch.
"""

from typing import NamedTuple

import torch


class SparseGrad(NamedTuple):
    """A logits gradient with K entries a row: dz[t, cols[t, k]] += vals[t, k] (entries
    naming one column add up). cols (n, K) int64 columns of the row function's logits,
    safe to read (an entry without a gradient: value 0 at any column); vals (n, K) in
    the math dtype (float32, float64 for float64 inputs)."""
    cols: torch.Tensor
    vals: torch.Tensor


def products(grad, hidden, w, needs, gh=None, gw_dtype=None, triton=False):
    """(gh, gw, gb) of a SparseGrad over all N tokens (N, K): gh written into the given
    (N, D) tensor (hidden's dtype, or float32 for a shard's partial sum), gw (V, D) in
    gw_dtype, gb (V,) in the math dtype; each None unless flagged in needs. hidden (N, D)
    and w (V, D) are the GEMMs' operands (hidden's dtype); triton: the Triton kernels
    (the backend's flag), else PyTorch."""
    cols, vals = grad.cols.contiguous(), grad.vals.contiguous()
    gather, scatter = _gather_rows, _scatter_rows
    if triton:
        from .sparse_kernels import gather, scatter
    if needs[0]:
        gather(cols, vals, w, gh)
    gw = gb = None
    if needs[1] or needs[2]:
        V, D = w.shape
        gw = torch.empty(V, D, dtype=gw_dtype, device=w.device) if needs[1] else None
        gb = torch.empty(V, dtype=vals.dtype, device=w.device) if needs[2] else None
        scatter(cols, vals, hidden, gw, gb)
    return gh, gw, gb


def scatter_add(grad, hidden, gw, triton=False):
    """gw[c] += the sum over grad's entries naming class c of vals * hidden[token], in
    place (gw float32; a class without entries is not touched), in the fixed order of
    products' scatter."""
    cols, vals = grad.cols.contiguous(), grad.vals.contiguous()
    if triton:
        from .sparse_kernels import scatter_add
        return scatter_add(cols, vals, hidden, gw)
    for k in range(cols.shape[1]):
        gw.index_add_(0, cols[:, k], _terms(vals[:, k, None], hidden))


def _terms(vals, rows):
    """vals (n, 1) times rows (n, D) in vals' dtype; 0 where the value is 0, whatever the
    row holds (an entry without gradient adds nothing, as in the kernels)."""
    return torch.where(vals != 0, vals * rows.to(vals.dtype), 0.0)


def _gather_rows(cols, vals, w, out):
    """out[t] = sum_k vals[t, k] w[cols[t, k]], summed in vals' dtype (k in order)."""
    acc = torch.zeros(out.shape, dtype=vals.dtype, device=out.device)
    for k in range(cols.shape[1]):
        acc += _terms(vals[:, k, None], w[cols[:, k]])
    out.copy_(acc)


def _scatter_rows(cols, vals, hidden, gw, gb):
    """gw[c] = sum of vals * hidden[token] and gb[c] = sum of vals over the entries
    naming class c (index_add_: in order off CUDA)."""
    if gw is not None:
        acc = torch.zeros(gw.shape, dtype=vals.dtype, device=gw.device)
        for k in range(cols.shape[1]):
            acc.index_add_(0, cols[:, k], _terms(vals[:, k, None], hidden))
        gw.copy_(acc)
    if gb is not None:
        gb.zero_().index_add_(0, cols.flatten(), vals.flatten())

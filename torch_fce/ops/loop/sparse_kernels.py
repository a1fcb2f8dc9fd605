"""Triton kernels of loop/sparse.py's products (CUDA; the interpreter in tests).

gather: one program a token and block of D, K rows of W read and summed in order (an
entry of value 0 reads nothing).
scatter: the entries of nonzero value stably sorted by class (torch.sort) and each
class's first entry found by searchsorted, so each class's row of the weight gradient
is one program's sum over its entries in token order, written once (a class without
entries: zeros); no atomics. A class named by every token is one program's loop over
the batch (N / 32 steps): the longest program.
scatter_add: the same sums added into a float32 gradient (the exp pipeline's one-hot
term, loop/exp_gemms.exp_tail): one program a sorted entry and block of 1024 of D, which
works only where a class's run of entries starts, so the grid is the entries' count, not
V (most classes have none: at V 151936 a grid over classes was 1M near-empty programs).
Most runs are one entry (a target named once in the batch): its program is a chain of
dependent loads (key, end, entry, row), so the block is wide and its gradient row read
before the entries (on an H100 at 16384 x 4096, blocks of 128 and 32 entries a step
took 3.5 ms).
"""

import torch
import triton
import triton.language as tl

_BLOCK_D = 128
_BLOCK_E = 32  # entries a step: a (BLOCK_E, BLOCK_D) tile
_ADD_BLOCK_D, _ADD_BLOCK_E, _ADD_WARPS = 1024, 8, 8  # scatter_add's tile


@triton.jit
def _gather_kernel(cols_ptr, vals_ptr, w_ptr, out_ptr, K, D, stride_w, stride_o,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros([BLOCK_D], dtype=vals_ptr.dtype.element_ty)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        c = tl.load(cols_ptr + row * K + ks, mask=kmask, other=0).to(tl.int64)
        v = tl.load(vals_ptr + row * K + ks, mask=kmask, other=0.0)
        x = tl.load(w_ptr + c[:, None] * stride_w + d[None, :],
                    mask=(kmask & (v != 0.0))[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(v[:, None] * x.to(v.dtype), axis=0)
    tl.store(out_ptr + row * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


def gather(cols, vals, w, out):
    """out[t] = sum_k vals[t, k] w[cols[t, k]] (sparse._gather_rows)."""
    N, K = cols.shape
    D = w.shape[1]
    assert w.stride(1) == 1 and out.stride(1) == 1
    if N:
        _gather_kernel[(N, triton.cdiv(D, _BLOCK_D))](
            cols, vals, w, out, K, D, w.stride(0), out.stride(0),
            BLOCK_K=min(triton.next_power_of_2(K), 16), BLOCK_D=_BLOCK_D)


@triton.jit
def _scatter_kernel(starts_ptr, order_ptr, vals_ptr, x_ptr, gw_ptr, gb_ptr, K, D, stride_x,
                    stride_w, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    cls = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    start = tl.load(starts_ptr + cls)
    end = tl.load(starts_ptr + cls + 1)
    acc = tl.zeros([BLOCK_D], dtype=vals_ptr.dtype.element_ty)
    bsum = tl.sum(tl.zeros([BLOCK_E], dtype=vals_ptr.dtype.element_ty), axis=0)
    for e0 in range(start, end, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        emask = es < end
        entry = tl.load(order_ptr + es, mask=emask, other=0)  # t * K + k
        v = tl.load(vals_ptr + entry, mask=emask, other=0.0)
        if HAS_W:
            x = tl.load(x_ptr + (entry // K)[:, None] * stride_x + d[None, :],
                        mask=emask[:, None] & dmask[None, :], other=0.0)
            acc += tl.sum(v[:, None] * x.to(v.dtype), axis=0)
        if HAS_B:
            bsum += tl.sum(v, axis=0)
    if HAS_W:
        tl.store(gw_ptr + cls * stride_w + d, acc.to(gw_ptr.dtype.element_ty), mask=dmask)
    if HAS_B:
        if tl.program_id(1) == 0:
            tl.store(gb_ptr + cls, bsum)


def _by_class(cols, vals, V):
    """(keys, order): the entries' classes stably sorted, those without gradient (a token
    not counted, padding) as V, past the last class: no program sums them (at class 0 they
    would make one program's work the batch's)."""
    keys = torch.where(vals.flatten() != 0, cols.flatten(), V)
    return torch.sort(keys, stable=True)


def scatter(cols, vals, hidden, gw, gb):
    """gw[c], gb[c]: the sums over the entries naming class c (sparse._scatter_rows)."""
    N, K = cols.shape
    V = (gw if gw is not None else gb).shape[0]
    D = hidden.shape[1]
    keys, order = _by_class(cols, vals, V)
    starts = torch.searchsorted(keys, torch.arange(V + 1, device=keys.device))
    assert hidden.stride(1) == 1 and (gw is None or gw.stride(1) == 1)
    blocks = triton.cdiv(D, _BLOCK_D) if gw is not None else 1
    _scatter_kernel[(V, blocks)](
        starts, order, vals, hidden, gw if gw is not None else vals,
        gb if gb is not None else vals, K, D, hidden.stride(0),
        gw.stride(0) if gw is not None else 0, HAS_W=gw is not None, HAS_B=gb is not None,
        BLOCK_E=_BLOCK_E, BLOCK_D=_BLOCK_D)


@triton.jit
def _scatter_add_kernel(keys_ptr, ends_ptr, order_ptr, vals_ptr, x_ptr, gw_ptr, K, D, V,
                        stride_x, stride_w, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    cls = tl.load(keys_ptr + p)
    prev = tl.load(keys_ptr + p - 1, mask=p > 0, other=-1)
    if (cls != prev) & (cls < V):  # the first entry of its class's run
        row = gw_ptr + cls * stride_w + d
        acc = tl.load(row, mask=dmask, other=0.0)  # read beside the entries' loads
        part = tl.zeros([BLOCK_D], dtype=tl.float32)
        end = tl.load(ends_ptr + p)
        for e0 in range(p, end, BLOCK_E):
            es = e0 + tl.arange(0, BLOCK_E)
            emask = es < end
            entry = tl.load(order_ptr + es, mask=emask, other=0)  # t * K + k
            v = tl.load(vals_ptr + entry, mask=emask, other=0.0)
            x = tl.load(x_ptr + (entry // K)[:, None] * stride_x + d[None, :],
                        mask=emask[:, None] & dmask[None, :], other=0.0)
            part += tl.sum(v[:, None] * x.to(tl.float32), axis=0)
        tl.store(row, acc + part, mask=dmask)


def scatter_add(cols, vals, hidden, gw):
    """gw[c] += the sum over the entries naming class c (gw, vals float32;
    sparse.scatter_add): a class without entries is not touched."""
    N, K = cols.shape
    V, D = gw.shape
    keys, order = _by_class(cols, vals, V)
    ends = torch.searchsorted(keys, keys, right=True)
    assert hidden.stride(1) == 1 and gw.stride(1) == 1
    if N * K:
        _scatter_add_kernel[(N * K, triton.cdiv(D, _ADD_BLOCK_D))](
            keys, ends, order, vals, hidden, gw, K, D, V, hidden.stride(0), gw.stride(0),
            BLOCK_E=_ADD_BLOCK_E, BLOCK_D=_ADD_BLOCK_D, num_warps=_ADD_WARPS)

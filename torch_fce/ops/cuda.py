"""The CUDA backend: the chunked loop with cuBLAS GEMMs and the Triton row kernel."""

import os

import torch

from . import checks, chunked
from .rows import torch_rows
from .triton.rows import triton_rows
from .triton.scale import _launch_scale_cast

# Bytes of one logits chunk (its gradient is written over it): a fixed workspace,
# whatever N is. Larger chunks keep the GEMMs large and amortise the float32 weight
# gradient's read-modify-write per chunk (docs/benchmarks.md has the trade-off).
WORKSPACE_BYTES = int(os.environ.get("TORCH_FCE_WORKSPACE_MB", "1024")) << 20
# Below the budget, a chunk is still at most this share of the logits, so the op saves
# memory also when all the logits would fit the workspace.
MIN_CHUNKS = 4


def _rows(dtype):
    return torch_rows if dtype == torch.float64 else triton_rows


def chunk_rows(N, V, dtype):
    """Rows per chunk: the workspace's worth, at most ceil(N / MIN_CHUNKS), rounded
    to a multiple of 128 (GEMM tiles) unless that is below one tile."""
    rows = WORKSPACE_BYTES // (V * torch.empty((), dtype=dtype).element_size())
    rows = min(rows, -(-N // MIN_CHUNKS))
    return max(1, rows // 128 * 128 if rows >= 128 else rows)


def _chunk_rows_for(hidden, weight):
    return chunk_rows(hidden.shape[0], weight.shape[0], hidden.dtype)


@torch.library.impl("fce::linear_ce_fwd", "CUDA")
def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, *options):
    if checks.CHECK_TARGETS:
        checks.check_target_range(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_fwd(
        hidden, weight, target, bias, class_weight, ignore_index, *options,
        rows=_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::linear_ce_bwd", "CUDA")
def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, *options):
    return chunked.linear_ce_bwd(
        grad_loss, hidden, weight, target, bias, class_weight, *options,
        rows=_rows(hidden.dtype), chunk_rows=_chunk_rows_for(hidden, weight))


@torch.library.impl("fce::scale_grad", "CUDA")
def scale_grad(grad, scale, dtype):
    out = grad.new_empty(grad.shape, dtype=dtype)
    _launch_scale_cast(grad.contiguous(), scale.to(grad.device), out)
    return out

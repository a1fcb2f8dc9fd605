"""An op's implementation with a chosen backend and chunk size: one device's row
functions on the shared loop, called directly (no dispatcher, no value checks)."""

import contextlib

import torch_fce
from torch_fce.ops.chunked import ONE_DEVICE
from torch_fce.ops.dispatch import Backend
from torch_fce.ops.distill_rows import TORCH_DISTILL_ROWS
from torch_fce.ops.logprob_rows import TORCH_LOGPROB_ROWS
from torch_fce.ops.rows import TORCH_CE_ROWS
from torch_fce.ops.triton.distill_rows import TRITON_DISTILL_ROWS
from torch_fce.ops.triton.logprob_rows import TRITON_LOGPROB_ROWS
from torch_fce.ops.triton.rows import TRITON_CE_ROWS

TORCH = Backend(TORCH_CE_ROWS, TORCH_LOGPROB_ROWS, TORCH_DISTILL_ROWS, check_values=False)
TRITON = Backend(TRITON_CE_ROWS, TRITON_LOGPROB_ROWS, TRITON_DISTILL_ROWS,
                 check_values=False)
BACKENDS = {"torch_rows": TORCH, "triton_rows": TRITON}


@contextlib.contextmanager
def chunks(rows, hidden, weight):
    """The loop cuts `rows` token rows per chunk (a workspace of that many logits rows)."""
    with torch_fce.workspace(rows * weight.shape[0] * hidden.element_size()):
        yield


__all__ = ["BACKENDS", "ONE_DEVICE", "TORCH", "TRITON", "chunks"]

"""An op's implementation with a chosen backend and chunk size: one device's row
functions on the shared loop, called directly (no dispatcher, no value checks)."""

import contextlib

import torch_fce
from torch_fce.ops.loop.chunked import ONE_DEVICE
from torch_fce.ops.machinery.dispatch import Backend
from torch_fce.ops.rowmath.distill import TORCH_DISTILL_ROWS
from torch_fce.ops.rowmath.logprob import TORCH_LOGPROB_ROWS
from torch_fce.ops.rowmath.ce import TORCH_CE_ROWS
from torch_fce.ops.rowmath.triton.distill import TRITON_DISTILL_ROWS
from torch_fce.ops.rowmath.triton.logprob import TRITON_LOGPROB_ROWS
from torch_fce.ops.rowmath.triton.ce import TRITON_CE_ROWS

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

"""The fce:: library and its one dispatch table: which row functions each device runs.

Every internal op has one implementation, written on the chunk loop (loop/chunked.py) for
any `Backend`; `kernel(name)` registers it for every device, picking the backend from
the inputs: CUDA tensors run the Triton row kernels (when Triton is installed; float64
keeps the PyTorch rows, the kernels' math is float32), every other device the PyTorch
rows. The GEMMs are torch's on every device.
"""

import functools
import importlib.util
from typing import Any, NamedTuple

import torch

from ..contract import checks
from ..rowmath.ce import TORCH_CE_ROWS
from ..rowmath.distill import TORCH_DISTILL_ROWS
from ..rowmath.logprob import TORCH_LOGPROB_ROWS
from ..rowmath.topk import topk_rows
from ..rowmath.truncation import TORCH_TRUNCATION_ROWS

LIB = torch.library.Library("fce", "DEF")

HAS_TRITON = importlib.util.find_spec("triton") is not None


class Backend(NamedTuple):
    """A device's row functions (ce.CERows, logprob.LogProbRows,
    distill.DistillRows, topk.topk_rows' signature, truncation.TruncationRows) and
    whether its kernels check target and temperature values (a host sync: always on
    the CPU, opt-in elsewhere with TORCH_FCE_CHECK_TARGETS=1, docs/api.md)."""
    ce: Any
    logprobs: Any
    distill: Any
    topk: Any
    truncation: Any
    check_values: bool


@functools.cache
def _triton_rows():
    from ..rowmath.triton.ce import TRITON_CE_ROWS
    from ..rowmath.triton.distill import TRITON_DISTILL_ROWS
    from ..rowmath.triton.logprob import TRITON_LOGPROB_ROWS, TRITON_TRUNCATION_ROWS
    from ..rowmath.triton.topk import triton_topk_rows

    return (TRITON_CE_ROWS, TRITON_LOGPROB_ROWS, TRITON_DISTILL_ROWS, triton_topk_rows,
            TRITON_TRUNCATION_ROWS)


def backend_for(hidden):
    """The backend for hidden's device and dtype."""
    check = hidden.device.type == "cpu" or checks.CHECK_TARGETS
    if hidden.device.type == "cuda" and HAS_TRITON and hidden.dtype != torch.float64:
        return Backend(*_triton_rows(), check)
    return Backend(TORCH_CE_ROWS, TORCH_LOGPROB_ROWS, TORCH_DISTILL_ROWS, topk_rows,
                   TORCH_TRUNCATION_ROWS, check)


def kernel(name, hidden=0):
    """Registers fn(*args, backend=...) as the op's implementation on every device;
    args[hidden] is the hidden states, which pick the backend."""
    def register(fn):
        @torch.library.impl(LIB, name, "CompositeExplicitAutograd")
        def impl(*args):
            return fn(*args, backend=backend_for(args[hidden]))
        return fn
    return register

"""The fce:: library and the backend an op's implementation runs with.

Every internal op has one implementation, written on the chunk loop (loop/chunked.py);
`kernel(name)` registers it for every device and hands it a `Backend` picked from the
inputs: CUDA tensors run the Triton row kernels (when Triton is installed; float64 keeps
the PyTorch rows, the kernels' math is float32), every other device the PyTorch rows.
Each op picks its own row function from `backend.triton` at one call site (its `_rows`);
the loop's Triton kernels (the Kahan sums, a sparse gradient's products) run where
`backend.sums` says. The GEMMs are torch's on every device.
"""

import importlib.util
from typing import NamedTuple, Optional

import torch

from ..contract import checks

LIB = torch.library.Library("fce", "DEF")

HAS_TRITON = importlib.util.find_spec("triton") is not None


class Backend(NamedTuple):
    """How an op runs on its inputs: triton, the Triton row kernels (else the PyTorch
    rows), and check_values, whether its kernels check target and temperature values (a
    host sync: always on the CPU, opt-in elsewhere with TORCH_FCE_CHECK_TARGETS=1,
    docs/api.md). Tests run the Triton kernels on CPU tensors (Triton's interpreter) by
    handing an op Backend(triton=True, ...). loop_triton: whether the loop's own Triton
    kernels run (None: as triton); on CUDA with Triton they always do, float64's PyTorch
    rows too (their products then use no atomics: deterministic, docs/api.md)."""
    triton: bool
    check_values: bool
    loop_triton: Optional[bool] = None

    @property
    def sums(self):
        """Whether the loop's Triton kernels run (run_chunks' triton)."""
        return self.triton if self.loop_triton is None else self.loop_triton


def backend_for(hidden):
    """The backend for hidden's device and dtype."""
    cuda = hidden.device.type == "cuda" and HAS_TRITON
    return Backend(triton=cuda and hidden.dtype != torch.float64,
                   check_values=hidden.device.type == "cpu" or checks.CHECK_TARGETS,
                   loop_triton=cuda)


def kernel(name, hidden=0):
    """Registers fn(*args, backend=...) as the op's implementation on every device;
    args[hidden] is the hidden states, which pick the backend."""
    def register(fn):
        @torch.library.impl(LIB, name, "CompositeExplicitAutograd")
        def impl(*args):
            return fn(*args, backend=backend_for(args[hidden]))
        return fn
    return register

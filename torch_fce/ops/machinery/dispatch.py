"""The fce:: library and the backend an op's implementation runs with.

Every internal op has one implementation, written on the chunk loop (loop/chunked.py);
`kernel(name)` registers it for every device and hands it a `Backend` picked from the
inputs: CUDA tensors run the Triton row kernels (when Triton is installed; float64 keeps
the PyTorch rows, the kernels' math is float32), every other device the PyTorch rows.
Each op picks its own row function from `backend.triton` at one call site (its `_rows`);
the loop's Triton kernels (the Kahan sums, a sparse gradient's products) run where
`backend.sums` says. The GEMMs are torch's on every device, except on the exp-GEMM
pipeline (loop/exp_gemms.py), which an op that has it (the cross entropy) runs where
`backend.exp` says and its options are served: opted into with TORCH_FCE_BACKEND=exp
(on CUDA it needs an sm_90 GPU and quack-kernels; elsewhere its PyTorch twin runs).
"""

import functools
import importlib.util
import os
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
    exp: bool = False  # the exp-GEMM pipeline, where the op serves the call

    @property
    def sums(self):
        """Whether the loop's Triton kernels run (run_chunks' triton)."""
        return self.triton if self.loop_triton is None else self.loop_triton


BACKENDS = ("triton", "exp")  # TORCH_FCE_BACKEND's values ("triton": the rows, default)


def _chosen():
    name = os.environ.get("TORCH_FCE_BACKEND", "triton")
    if name not in BACKENDS:
        raise ValueError(f"TORCH_FCE_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name


@functools.cache
def exp_on_cuda(index):
    """Whether CUDA device `index` runs the exp-GEMM pipeline's CuTe kernels: sm_90 with
    quack-kernels and its cutlass-dsl importable (an installed quack whose cutlass-dsl
    runtime is missing or broken does not import: today's path runs)."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        importlib.import_module("quack.epilogue.frontend")
        importlib.import_module("quack.operand_transform")
    except Exception:  # noqa: BLE001 (an optional extra: any failure means "not here")
        return False
    return True


def backend_for(hidden):
    """The backend for hidden's device and dtype."""
    cuda = hidden.device.type == "cuda" and HAS_TRITON
    exp = _chosen() == "exp" and (hidden.device.type == "cpu" or (
        hidden.device.type == "cuda" and exp_on_cuda(hidden.device.index or 0)))
    return Backend(triton=cuda and hidden.dtype != torch.float64,
                   check_values=hidden.device.type == "cpu" or checks.CHECK_TARGETS,
                   loop_triton=cuda, exp=exp)


def kernel(name, hidden=0):
    """Registers fn(*args, backend=...) as the op's implementation on every device;
    args[hidden] is the hidden states, which pick the backend."""
    def register(fn):
        @torch.library.impl(LIB, name, "CompositeExplicitAutograd")
        def impl(*args):
            return fn(*args, backend=backend_for(args[hidden]))
        return fn
    return register

"""The Triton kernels this machine runs only in the interpreter also compile for CUDA:
Triton's code generator (ttir to cubin, for sm_90, no GPU needed) on the sparse
divergence's row kernels in each of their variants (one device and a vocabulary
shard's two), the sparse rows' logsumexp kernel and the loop's sparse-gradient kernels.
The interpreter runs Python, so what only the code generator refuses (a loop-carried
variable changing shape, say) shows here first. In a process of its own: the tests'
TRITON_INTERPRET=1 makes every @triton.jit an interpreted function."""

import os
import subprocess
import sys

import pytest
import triton

_HAS_NVIDIA = os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends",
                                         "nvidia"))

_SCRIPT = '''
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torch_fce.ops.loop import sparse_kernels
from torch_fce.ops.linear_sparse_divergence import kernels as divergence
from torch_fce.ops.rowmath import sparse_rows_kernels as sparse_rows

def build(fn, signature, constants, warps):
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    kernel = triton.compile(ASTSource(fn, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert kernel.asm["cubin"]
    print("compiled", fn.__name__, constants)

sig = {"z_ptr": "*fp32", "dz_ptr": "*bf16", "support_ptr": "*i64", "teacher_ptr": "*fp32",
       "tail_ptr": "*fp32", "inv_t_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32",
       "g_ptr": "*fp32", "cols_ptr": "*i64", "part_ptr": "*fp32", "n": "i32", "V": "i32",
       "V_all": "i32", "start": "i32", "K": "i32", "ignore_index": "i32", "beta": "fp32",
       "one_m_beta": "fp32", "scale": "fp32", "cap": "fp32", "stride_z": "i32",
       "stride_d": "i32"}
for kind, tail, grad, cap, block_k, part in [
        c + (64, False) for c in itertools.product([0, 1, 2], [True, False], [True, False],
                                                   [True, False])] + [
        (0, True, True, False, 8, False), (2, True, True, True, 64, True),
        (1, False, True, False, 64, True)]:
    build(divergence._sparse_divergence_kernel, sig,
          dict(KIND=kind, TAIL=tail, HAS_GRAD=grad, HAS_CAP=cap, OVER=True, BLOCK_V=4096,
               BLOCK_K=block_k, SUB_K=min(block_k, 16), FROM_PART=part), divergence._WARPS)
for tail, cap in itertools.product([True, False], [True, False]):
    build(divergence._sparse_sums_kernel,
          {k: sig[k] for k in ("z_ptr", "support_ptr", "teacher_ptr", "inv_t_ptr", "g_ptr",
                               "part_ptr", "n", "V", "V_all", "start", "K", "ignore_index",
                               "scale", "cap", "stride_z")},
          dict(TAIL=tail, HAS_CAP=cap, BLOCK_V=4096, BLOCK_K=64), divergence._WARPS)
build(sparse_rows._sparse_stats_kernel,
      {"z_ptr": "*fp32", "inv_t_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "V": "i32",
       "stride_z": "i32", "scale": "fp32", "cap": "fp32"},
      dict(HAS_CAP=True, BLOCK_V=4096), sparse_rows._WARPS)
build(sparse_kernels._gather_kernel,
      {"cols_ptr": "*i64", "vals_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16",
       "K": "i32", "D": "i32", "stride_w": "i32", "stride_o": "i32"},
      dict(BLOCK_K=16, BLOCK_D=128), 4)
for weights, bias in [(True, True), (True, False), (False, True)]:
    build(sparse_kernels._scatter_kernel,
          {"starts_ptr": "*i64", "order_ptr": "*i64", "vals_ptr": "*fp32", "x_ptr": "*bf16",
           "gw_ptr": "*fp32", "gb_ptr": "*fp32", "K": "i32", "D": "i32", "stride_x": "i32",
           "stride_w": "i32"},
          dict(HAS_W=weights, HAS_B=bias, BLOCK_E=32, BLOCK_D=128), 4)
'''


@pytest.mark.skipif(not _HAS_NVIDIA, reason="Triton without its CUDA backend")
def test_kernels_compile_for_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("compiled") == 36

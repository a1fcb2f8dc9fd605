"""Would a TMA persistent GEMM speed up the "kahan" weight-gradient update?

torch_fce's Kahan GEMM (ops/loop/kahan.py) uses pointer loads. This probe writes the
same compensated update as a persistent Triton GEMM fed by TMA descriptors and times
both, per issue-3 shape at the backend's chunk size, against cuBLAS's bf16 matmul and
its float32-output addmm (what "fp32" uses) of the same product.

    python torch_fce/bench/probes/kahan_tma.py     # needs one CUDA GPU
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_fce.bench.shapes import SHAPES
from torch_fce.ops.loop.workspace import chunk_rows
from torch_fce.ops.loop.kahan import _launch_kahan_addmm

from torch_fce.bench.probes._common import at_b_tile, ms, run_shapes, tile_pid

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, warp_specialize); 128 x 256 tiles
# need more shared memory than an H200 SM has for these operand layouts.
CONFIGS = [(128, 128, 64, 3, 4, False), (128, 128, 64, 4, 8, False),
           (128, 128, 64, 4, 8, True), (128, 128, 64, 5, 8, False)]


@triton.jit
def _kahan_tma_kernel(
    # descriptors
    a_desc, b_desc, s_desc, c_desc,
    # sizes
    M, N, K,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr,
):
    """A (K, M), B (K, N); S and C (M, N) += A.T @ B with Kahan compensation."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    tile_c = start - NUM_SMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                         warp_specialize=WS):
        pid_m, pid_n = tile_pid(tile, per_group, num_pid_m, GROUP_M)
        acc = at_b_tile(a_desc, b_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_c += NUM_SMS
        pid_m, pid_n = tile_pid(tile_c, per_group, num_pid_m, GROUP_M)
        at = [pid_m * BLOCK_M, pid_n * BLOCK_N]
        s = s_desc.load(at).to(tl.float32)
        y = acc - c_desc.load(at).to(tl.float32)
        t = (s + y).to(s_desc.dtype)
        c_desc.store(at, ((t.to(tl.float32) - s) - y).to(c_desc.dtype))
        s_desc.store(at, t)


def kahan_tma(a, b, s, c, cfg):
    bm, bn, bk, stages, warps, ws = cfg
    K, M = a.shape
    N = b.shape[1]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _kahan_tma_kernel[(min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)](
        TensorDescriptor.from_tensor(a, [bk, bm]), TensorDescriptor.from_tensor(b, [bk, bn]),
        TensorDescriptor.from_tensor(s, [bm, bn]), TensorDescriptor.from_tensor(c, [bm, bn]),
        M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, WS=ws,
        num_stages=stages, num_warps=warps)


def probe_shape(name):
    """Probes one issue-3 shape; its tensors are freed on return."""
    N, D, V = SHAPES[name].N, SHAPES[name].D, SHAPES[name].V
    n = chunk_rows(N, V, D, torch.bfloat16, "cuda")
    a = torch.randn(n, V, device="cuda", dtype=torch.bfloat16) * 0.01  # dz
    b = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)  # hidden
    acc32 = torch.zeros(V, D, device="cuda")
    s, c = (torch.zeros(V, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm = ms(lambda: torch.mm(a.t(), b))
    f32 = ms(lambda: torch.addmm(acc32, a.t(), b, out_dtype=torch.float32, out=acc32))
    cur = ms(lambda: _launch_kahan_addmm(a, b, s, c))
    print(f"{name} (dW chunk {V} x {D}, K={n}): x cuBLAS bf16 mm ({mm:.2f} ms): "
          f"float32 addmm {f32 / mm:.2f}, current Kahan {cur / mm:.2f}", flush=True)
    s2, c2 = torch.zeros_like(s), torch.zeros_like(c)
    _launch_kahan_addmm(a, b, s2, c2)
    for cfg in CONFIGS:
        try:
            s.zero_(), c.zero_()
            kahan_tma(a, b, s, c, cfg)
            same = torch.equal(s, s2) and torch.equal(c, c2)
            t = ms(lambda: kahan_tma(a, b, s, c, cfg))
            print(f"  TMA {cfg}: {t / mm:.2f}x mm = {t / cur:.2f}x current "
                  f"(first update bit-equal to current: {same})", flush=True)
        except triton.runtime.errors.OutOfResources as e:
            print(f"  TMA {cfg}: {e}")


if __name__ == "__main__":
    run_shapes(probe_shape)

"""Can the weight gradient's float32 sum across token chunks skip re-reading itself?

Every chunk after the first adds dz.T @ h into the (V, D) float32 sum: cuBLAS's addmm
reads the sum and writes it back (8VD bytes per chunk), which at small D costs as much as
a sizeable part of the GEMM. This probe builds a persistent TMA Triton GEMM for the same
product whose epilogue adds the tile into the sum with TMA reduce-add stores (the add
happens in L2, the sum is never loaded into the SM), and prints, at the CUDA backend's
chunk, cuBLAS mm (no sum), cuBLAS addmm (the one in use) and the Triton GEMM storing and
reduce-adding, each over one chunk, and the error of each against a float64 product.

    python torch_fce/bench/probes/dw_reduce_add.py D E Q2048 A     # needs one CUDA GPU
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_fce.bench.shapes import SHAPES
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import at_b_tile, ms, run_shapes, tile_pid

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, warp_specialize, epilogue halves)
CONFIGS = [(128, 128, 64, 4, 4, False, False), (128, 128, 64, 4, 8, False, False),
           (128, 256, 64, 3, 8, False, True), (128, 256, 64, 4, 8, True, True),
           (256, 128, 64, 3, 8, False, True)]


@triton.jit
def _dw_kernel(dz_desc, h_desc, gw_desc, M, N, K, ADD: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_SMS: tl.constexpr, WS: tl.constexpr, HALVES: tl.constexpr):
    """gw (M, N) float32 (+)= dz (K, M).T @ h (K, N)."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    tile_c = start - NUM_SMS
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                         warp_specialize=WS):
        pid_m, pid_n = tile_pid(tile, per_group, num_pid_m, GROUP_M)
        acc = at_b_tile(dz_desc, h_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_c += NUM_SMS
        pid_m, pid_n = tile_pid(tile_c, per_group, num_pid_m, GROUP_M)
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        if HALVES:
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)),
                                         (0, 2, 1)))
            if ADD:
                gw_desc.atomic_add([m0, n0], a0)
                gw_desc.atomic_add([m0, n0 + BLOCK_N // 2], a1)
            else:
                gw_desc.store([m0, n0], a0)
                gw_desc.store([m0, n0 + BLOCK_N // 2], a1)
        else:
            if ADD:
                gw_desc.atomic_add([m0, n0], acc)
            else:
                gw_desc.store([m0, n0], acc)


def dw_triton(dz, h, gw, cfg, add):
    bm, bn, bk, stages, warps, ws, halves = cfg
    K, M = dz.shape
    N = h.shape[1]
    sms = torch.cuda.get_device_properties(dz.device).multi_processor_count
    _dw_kernel[(min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)](
        TensorDescriptor.from_tensor(dz, [bk, bm]), TensorDescriptor.from_tensor(h, [bk, bn]),
        TensorDescriptor.from_tensor(gw, [bm, bn // 2 if halves else bn]), M, N, K, ADD=add,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, WS=ws, HALVES=halves,
        num_stages=stages, num_warps=warps)


def probe_shape(name):
    """Probes one shape at the backend's chunk; its tensors are freed on return."""
    N, D, V = SHAPES[name].N, SHAPES[name].D, SHAPES[name].V
    n = chunk_rows(N, V, D, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = (torch.randn(n, V, device="cuda", generator=g) * 1e-3).bfloat16()
    h = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    gw0 = torch.randn(V, D, device="cuda", generator=g)
    want = (gw0.double() + dz.double().T @ h.double())
    gw = gw0.clone()

    def err(x):
        return ((x.double() - want).norm() / want.norm()).item()

    mm = ms(lambda: torch.mm(dz.t(), h, out_dtype=torch.float32, out=gw))
    addmm = ms(lambda: torch.addmm(gw, dz.t(), h, out_dtype=torch.float32, out=gw))
    gw.copy_(gw0)
    torch.addmm(gw, dz.t(), h, out_dtype=torch.float32, out=gw)
    print(f"{name} (chunk {n} x {V}, D={D}): cuBLAS mm {mm:.3f} ms, addmm {addmm:.3f} ms "
          f"(+{addmm - mm:.3f}; err {err(gw):.1e}); 8VD bytes at 3.3 TB/s "
          f"{8 * V * D / 3.3e9:.3f} ms", flush=True)
    for cfg in CONFIGS:
        try:
            store = ms(lambda: dw_triton(dz, h, gw, cfg, False))
            add = ms(lambda: dw_triton(dz, h, gw, cfg, True))
            gw.copy_(gw0)
            dw_triton(dz, h, gw, cfg, True)
            print(f"  {cfg}: store {store:.3f} ms ({store / mm:.3f}x mm), reduce-add "
                  f"{add:.3f} ms ({add / addmm:.3f}x addmm; err {err(gw):.1e})", flush=True)
        except Exception as e:  # noqa: BLE001 - a config that cannot build is a result
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    run_shapes(probe_shape)

"""Does fusing the logsumexp sweep into the logits GEMM pay? (Triton, TMA, persistent.)

torch_fce's chunk loop runs the logits GEMM on cuBLAS and then a row kernel that reads
each logit twice (logsumexp, then the gradient) and writes it once. This probe builds
the alternative: a persistent TMA Triton GEMM whose epilogue also writes each tile's
row-wise (max, sum exp) from the float32 accumulator, followed by a kernel that merges
those partials into the logsumexp and makes the single gradient sweep. It prints, per
issue-3 shape at the backend's chunk size, the plain Triton GEMM and the fused pair
against cuBLAS + the row kernel.

    python torch_fce/bench/probes/fused_logits_epilogue.py     # needs one CUDA GPU
"""

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_fce.bench.shapes import SHAPES
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import ce_row_grad, ms, run_shapes, tile_pid

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, warp_specialize, epilogue subtile)
CONFIGS = [(128, 256, 64, 3, 8, False, True), (128, 256, 64, 4, 8, False, True),
           (128, 256, 64, 3, 8, True, True), (128, 256, 64, 4, 8, True, True),
           (128, 256, 64, 3, 8, False, False)]
if os.environ.get("PROBE_CONFIGS"):  # a subset, e.g. PROBE_CONFIGS=0,2
    CONFIGS = [CONFIGS[int(i)] for i in os.environ["PROBE_CONFIGS"].split(",")]


@triton.jit
def _tile_stats(acc, cols, N):
    z = tl.where(cols[None, :] < N, acc, -1.0e30)
    m = tl.max(z, 1)
    return m, tl.sum(tl.exp(z - m[:, None]), 1)


@triton.jit
def _logits_stats_kernel(
    # descriptors and pointers
    h_desc, w_desc, z_desc, m_ptr, s_ptr,
    # sizes
    M, N, K,
    # meta-parameters
    STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    WS: tl.constexpr, SUBTILE: tl.constexpr,
):
    """z (M, N) = h (M, K) @ w (N, K).T; with STATS, m/s (M, cdiv(N, BLOCK_N)) float32
    hold each tile's row max and sum of exp(z - max)."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    tile_c = start - NUM_SMS  # the epilogue's own counter keeps the pipeliner happy
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                         warp_specialize=WS):
        pid_m, pid_n = tile_pid(tile, per_group, num_pid_m, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = h_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        tile_c += NUM_SMS
        pid_m, pid_n = tile_pid(tile_c, per_group, num_pid_m, GROUP_M)
        row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        if SUBTILE:  # two half tiles: less shared memory and fewer live registers
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)),
                                         (0, 2, 1)))
            z_desc.store([row0, col0], a0.to(z_desc.dtype))
            z_desc.store([row0, col0 + BLOCK_N // 2], a1.to(z_desc.dtype))
            if STATS:
                cols = col0 + tl.arange(0, BLOCK_N // 2)
                m0, s0 = _tile_stats(a0, cols, N)
                m1, s1 = _tile_stats(a1, cols + BLOCK_N // 2, N)
                m = tl.maximum(m0, m1)
                s = s0 * tl.exp(m0 - m) + s1 * tl.exp(m1 - m)
        else:
            z_desc.store([row0, col0], acc.to(z_desc.dtype))
            if STATS:
                m, s = _tile_stats(acc, col0 + tl.arange(0, BLOCK_N), N)
        if STATS:
            tl.store(m_ptr + rows * num_pid_n + pid_n, m, mask=rows < M)
            tl.store(s_ptr + rows * num_pid_n + pid_n, s, mask=rows < M)


@triton.jit
def _merge_grad_kernel(z_ptr, m_ptr, s_ptr, target_ptr, lse_ptr, N, P, stride_zm, scale,
                       BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr):
    """Per row: lse from the P tile partials, then z <- scale * (softmax - onehot)."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_P)
    m = tl.full([BLOCK_P], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        mask = p0 + parts < P
        mi = tl.load(m_ptr + row * P + p0 + parts, mask=mask, other=-1.0e30)
        si = tl.load(s_ptr + row * P + p0 + parts, mask=mask, other=0.0)
        mn = tl.maximum(m, mi)
        s = s * tl.exp(m - mn) + si * tl.exp(mi - mn)
        m = mn
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
    tl.store(lse_ptr + row, lse)
    t = tl.load(target_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    row_ptr = z_ptr + row * stride_zm
    for v0 in range(0, N, BLOCK_V):
        offs = v0 + cols
        mask = offs < N
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dz = scale * (tl.exp(z - lse) - tl.where(offs == t, 1.0, 0.0))
        tl.store(row_ptr + offs, dz.to(row_ptr.dtype.element_ty), mask=mask)


def logits_stats(h, w, z, cfg, stats=True):
    bm, bn, bk, stages, warps, ws, subtile = cfg
    M, K = h.shape
    N = w.shape[0]
    m, s = (h.new_empty(M, triton.cdiv(N, bn), dtype=torch.float32) for _ in range(2))
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    _logits_stats_kernel[(min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)](
        TensorDescriptor.from_tensor(h, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(z, [bm, bn // 2 if subtile else bn]), m, s, M, N, K,
        STATS=stats, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, WS=ws,
        SUBTILE=subtile, num_stages=stages, num_warps=warps)
    return m, s


def merge_grad(z, m, s, target, scale):
    lse = z.new_empty(z.shape[0], dtype=torch.float32)
    _merge_grad_kernel[(z.shape[0],)](z, m, s, target, lse, z.shape[1], m.shape[1],
                                      z.stride(0), scale, BLOCK_V=4096, BLOCK_P=128,
                                      num_warps=8)
    return lse


def probe_shape(name):
    """Probes one issue-3 shape; its tensors are freed on return."""
    N, D, V = SHAPES[name].N, SHAPES[name].D, SHAPES[name].V
    n = chunk_rows(N, V, D, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(n, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * 2).bfloat16()
    t = torch.randint(0, V, (n,), device="cuda", generator=g)
    z = torch.empty(n, V, dtype=torch.bfloat16, device="cuda")
    ce, zs = torch.full((n,), 1.0 / n, device="cuda"), torch.zeros(n, device="cuda")
    ref_lse = torch.logsumexp(torch.mm(h, w.T, out_dtype=torch.float32), 1)
    cublas = ms(lambda: torch.mm(h, w.T, out=z))
    base = ms(lambda: (torch.mm(h, w.T, out=z),
                       ce_row_grad(z, t, ce, zs)))
    print(f"{name} (chunk {n} x {V}, K={D}): cuBLAS logits {cublas:.3f} ms, "
          f"+ row kernel {base:.3f} ms", flush=True)
    for cfg in CONFIGS:
        try:
            lse = merge_grad(z, *logits_stats(h, w, z, cfg), t, 1.0 / n)
            err = (lse - ref_lse).abs().max().item()
            plain = ms(lambda: logits_stats(h, w, z, cfg, stats=False))
            stats = ms(lambda: logits_stats(h, w, z, cfg))
            fused = ms(lambda: merge_grad(z, *logits_stats(h, w, z, cfg), t, 1.0 / n))
            print(f"  {cfg}: plain GEMM {plain / cublas:.3f}x cuBLAS, with stats "
                  f"{stats / cublas:.3f}x; fused pair {fused:.3f} ms = "
                  f"{fused / base:.3f}x cuBLAS + row kernel (lse err {err:.1e})", flush=True)
        except triton.runtime.errors.OutOfResources as e:
            print(f"  {cfg}: {e}")


if __name__ == "__main__":
    run_shapes(probe_shape)

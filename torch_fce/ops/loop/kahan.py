"""Triton GEMM with a Kahan-summation epilogue: (S, C) += A.T @ B, compensated.

Used by the "kahan" accumulator on CUDA: the weight gradient S (V, D) and its
compensation C are stored in the input dtype (half of a float32 sum's memory), each
chunk's product A.T @ B (A = dz (n, V), B = hidden (n, D)) is formed in float32 in
registers and added to S with the compensated update, so no float32 (V, D) buffer and
no extra pass over S are needed.
"""

import os

import triton
import triton.language as tl


@triton.jit
def _kahan_addmm_kernel(
    # pointers
    a_ptr, b_ptr, s_ptr, c_ptr,
    # sizes
    M, N, K,
    # strides
    stride_ak, stride_am, stride_bk, stride_bn, stride_sm, stride_sn,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
):
    """A (K, M), B (K, N), S and C (M, N): S + C stays the exact running sum."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: programs sharing B tiles run together (L2 reuse).
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_k[:, None] * stride_ak + offs_m[None, :] * stride_am
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=k_mask[:, None] & (offs_m[None, :] < M), other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # Triton's CPU interpreter mishandles bf16 tl.dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # ---- epilogue: compensated update of (S, C) ----------------------------------
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    off = offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn
    s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + off, mask=mask, other=0.0).to(tl.float32)
    y = acc - c
    t = (s + y).to(s_ptr.dtype.element_ty)
    tl.store(c_ptr + off, ((t.to(tl.float32) - s) - y).to(c_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + off, t, mask=mask)


def _launch_kahan_addmm(a, b, s, c):
    """(s, c) += a.T @ b with compensation; a (K, M), b (K, N), s and c (M, N)."""
    K, M = a.shape
    N = b.shape[1]
    assert b.shape[0] == K and s.shape == c.shape == (M, N) and s.stride() == c.stride()
    # Triton's interpreter returns garbage for tl.dot of bf16 operands: there (tests on
    # the CPU) the tiles are upcast first, the one path a test does not share with the GPU
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    bm, bn, bk = 128, 128, 64
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _kahan_addmm_kernel[grid](
        a, b, s, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), s.stride(0), s.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, UPCAST=interpret,
        num_warps=4, num_stages=3,
    )

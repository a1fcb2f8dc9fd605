"""Can the row kernel's second read of each logit come from L2 instead of HBM?

torch_fce's row kernel (ops/linear_ce/kernels.py) reads a chunk's logits twice and writes
them once, one program per row. If the second read hit L2 the kernel would move 2 instead of
3 bytes per byte of logits. This probe times the row kernel's core (online logsumexp,
then the gradient sweep) in variants meant to keep rows L2-resident: persistent programs
(1-2 per SM) with large blocks, and "evict_last"/"evict_first" hints, against the
kernel in use, per issue-3 shape at the backend's chunk size.

    python torch_fce/bench/probes/row_sweeps.py     # needs one CUDA GPU
"""

import itertools

import torch
import triton
import triton.language as tl

from torch_fce.bench.shapes import SHAPES
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import ce_row_grad, ms, run_shapes


@triton.jit
def _row_sweeps_kernel(z_ptr, target_ptr, scale_ptr, lse_ptr, V, n_rows, stride_zn,
                       PERSISTENT: tl.constexpr, BLOCK_V: tl.constexpr,
                       EVICT_1: tl.constexpr, EVICT_2: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    step = tl.num_programs(0) if PERSISTENT else n_rows
    for r in range(tl.program_id(0), n_rows, step):
        row = r.to(tl.int64)
        row_ptr = z_ptr + row * stride_zn
        m = tl.max(tl.full([BLOCK_V], -1.0e30, tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
        for v0 in range(0, V, BLOCK_V):
            z = tl.load(row_ptr + v0 + cols, mask=v0 + cols < V, other=float("-inf"),
                        eviction_policy=EVICT_1).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        t = tl.load(target_ptr + row).to(tl.int64)
        a = tl.load(scale_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            z = tl.load(row_ptr + offs, mask=offs < V, other=0.0,
                        eviction_policy=EVICT_2).to(tl.float32)
            dz = a * (tl.exp(z - lse) - tl.where(offs == t, 1.0, 0.0))
            tl.store(row_ptr + offs, dz.to(row_ptr.dtype.element_ty), mask=offs < V,
                     eviction_policy=EVICT_2)


def variants():
    for per_sm, warps, block in itertools.product((0, 1, 2), (8, 16),
                                                  (4096, 8192, 16384, 32768)):
        if 4 <= block // (32 * warps) <= 64:  # elements per thread per load
            for hints in (("", ""), ("evict_last", "evict_first")):
                yield per_sm, warps, block, hints


def probe_shape(name):
    """Probes one issue-3 shape; its tensors are freed on return."""
    V = SHAPES[name].V
    n = chunk_rows(SHAPES[name].N, V, SHAPES[name].D, torch.bfloat16, "cuda")
    z = torch.randn(n, V, device="cuda").bfloat16()
    t = torch.randint(0, V, (n,), device="cuda")
    ce, zs = torch.full((n,), 1e-4, device="cuda"), torch.zeros(n, device="cuda")
    lse = torch.empty(n, device="cuda")
    base = ms(lambda: ce_row_grad(z, t, ce, zs))
    print(f"{name} ({n} x {V}): row kernel in use {base:.3f} ms "
          f"({3 * z.numel() * 2 / base / 1e9:.2f} TB/s for 2 reads + 1 write)", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timed = []
    for per_sm, warps, block, hints in variants():
        grid = n if per_sm == 0 else min(n, sms * per_sm)
        timed.append((ms(lambda: _row_sweeps_kernel[(grid,)](
            z, t, ce, lse, V, n, z.stride(0), PERSISTENT=per_sm > 0, BLOCK_V=block,
            EVICT_1=hints[0], EVICT_2=hints[1], num_warps=warps)),
            per_sm, warps, block, hints[0] or "none"))
    for t_ms, per_sm, warps, block, hints in sorted(timed)[:5]:
        print(f"  {base / t_ms:.2f}x faster: programs/SM {per_sm or 'all rows'}, "
              f"warps {warps}, BLOCK_V {block}, hints {hints}", flush=True)


if __name__ == "__main__":
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")
    run_shapes(probe_shape)

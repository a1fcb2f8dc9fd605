"""Triton kernel: out = (x * scale).to(out dtype) in one vectorised pass.

The backward of a scalar loss applies the upstream gradient to the weight gradient the
forward computed in float32; rounding only after the scaling keeps the result exact.
"""

import triton
import triton.language as tl


@triton.jit
def _scale_cast_kernel(x_ptr, scale_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    # int64: weight gradients pass 2^31 elements (V * D of large models).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    s = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_scale_cast(x, scale, out):
    """out = x * scale for contiguous x and out of the same shape; scale a 0-d tensor."""
    assert x.is_contiguous() and out.is_contiguous() and x.shape == out.shape
    BLOCK = 4096
    _scale_cast_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, scale, out, x.numel(), BLOCK=BLOCK,
                                                         num_warps=8)

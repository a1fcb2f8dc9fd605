"""Cross-token sums of the weight gradient, at the precision `accumulator` asks for.

  "fp32"  float32 sum (also whenever the weight itself is float32: master weights get
          their gradient summed straight into float32).
  "kahan" sum in the input dtype plus a compensation term of the same dtype.
  "input" plain sum in the input dtype.
Each chunk's partial product a.T @ b is formed with float32 accumulation in all modes.
"""

import torch

# Off CUDA, Kahan updates go through float32 partials of at most this many elements, so the
# "kahan" mode never holds a weight-sized float32 buffer.
_KAHAN_BLOCK_ELEMS = 1 << 24


def _mm_f32(a, b, out=None):
    """a @ b summed in float32 or better: a float32 product of low-precision a and b, or
    with out, the product rounded once into out's dtype (in place; no temporary on
    CUDA)."""
    low = a.dtype in (torch.bfloat16, torch.float16)
    cuda_low = low and a.device.type == "cuda"
    if out is not None and out.dtype == a.dtype and (cuda_low or not low):
        return torch.mm(a, b, out=out)  # cuBLAS sums low-precision products in float32
    if cuda_low and out is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    if cuda_low:  # float32 master weights' gradient
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    r = a.float() @ b.float() if low else a @ b  # on CPU, low precision upcasts first
    return r if out is None else out.copy_(r)


class GradAccumulator:
    """Accumulates sum over chunks of a.T @ b into a (V, D) buffer; triton: the Kahan
    sums in their Triton GEMM (the backend's flag), else float32 partials."""

    def __init__(self, mode, shape, compute_dtype, weight_dtype, device, triton=False):
        exact = compute_dtype in (torch.float32, torch.float64)
        self.sum_dtype = compute_dtype if exact else (
            torch.float32 if mode == "fp32" or weight_dtype == torch.float32 else compute_dtype
        )
        self.shape, self.device, self.triton = shape, device, triton
        kahan = mode == "kahan" and self.sum_dtype == compute_dtype and not exact
        # Plain sums start from the first product (no zero fill, no read of zeros).
        self.acc = torch.zeros(shape, dtype=self.sum_dtype, device=device) if kahan else None
        self.comp = torch.zeros_like(self.acc) if kahan else None

    def add(self, a, b, rows=None):
        """acc += a.T @ b for a (n, V), b (n, D) in the compute dtype; rows (a slice):
        into those rows of acc alone (its sum then starts from zeros)."""
        if self.comp is not None:
            assert rows is None
            return self._kahan_add(a, b)
        if self.acc is None and rows is None:
            self.acc = a.t() @ b if self.sum_dtype == a.dtype else _mm_f32(a.t(), b)
            return
        if self.acc is None:
            self.acc = torch.zeros(self.shape, dtype=self.sum_dtype, device=self.device)
        acc = self.acc if rows is None else self.acc[rows]
        if self.sum_dtype == a.dtype:
            acc.addmm_(a.t(), b)
        elif a.device.type == "cuda":
            torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
        else:
            acc.addmm_(a.t().float(), b.float())

    def _kahan_add(self, a, b):
        if self.triton:
            from .kahan import _launch_kahan_addmm

            return _launch_kahan_addmm(a, b, self.acc, self.comp)
        rows = max(1, _KAHAN_BLOCK_ELEMS // max(1, b.shape[1]))
        for v in range(0, self.acc.shape[0], rows):
            acc, comp = self.acc[v:v + rows], self.comp[v:v + rows]
            y = _mm_f32(a[:, v:v + rows].t(), b) - comp.float()
            t = acc.float() + y
            new = t.to(acc.dtype)
            comp.copy_((new.float() - acc.float()) - y)
            acc.copy_(new)

    def result(self, dtype):
        if self.acc is None:  # no tokens
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        if self.comp is not None:
            # The compensation holds minus the lost low-order part. Subtracting in place
            # keeps the peak at the two sums instead of three weight-sized buffers.
            self.acc.sub_(self.comp)
            self.comp = None
        return self.acc.to(dtype)

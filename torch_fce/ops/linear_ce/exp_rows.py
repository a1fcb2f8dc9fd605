"""The cross entropy's row math on the exp-GEMM pipeline (loop/exp_gemms.py).

From a chunk's ExpTile (per-(row, n-tile) partials, the target's float32 logit) to the
same per-token terms as rows.py (lse, nll, smooth) and the logits gradient as an
ExpGrad: with p = softmax(z) = E u / S (S = sum_t sum_exp 2^(k_t - k_r), so lse = k_r ln2
+ log S), rows.grad_coefficients' dz_c = p_c A - B [c == y] - C w_c is v = A / S on the
E u term, b = B at the target, cs = C.
The logits are the GEMM's float32 sums (logits_dtype has nothing to round: none of them
is stored), so the loss and gradients are at least as exact as the chunk loop's against
float64 (bench/probes/fused_pipeline_numerics.py).
"""

import torch

from ..loop import exp_gemms
from ..loop.tokens import counted_target_weights
from .rows import CETerms, dft_weight, grad_coefficients


def serves(hidden, weight, bias, opts):
    """Whether the pipeline runs this call (else the chunk loop does): no bias, no
    softcap (its derivative is per logit), the "fp32" accumulator, operands it takes."""
    return (bias is None and opts.softcap is None and opts.accumulator == "fp32"
            and exp_gemms.served(hidden, weight))


def exp_rows(tile, target, class_weight, scales, opts, V, zsum):
    """(CETerms, ExpGrad or None) of a chunk of m rows, each (m,): target (n,), n <= m,
    the chunk's tokens (the rows past them are padding, ignored), scales None (no
    gradient) or (ce_scale, z_scale) (n,), zsum (m,) sum_c w_c z_c (label smoothing) or
    None. Its Triton twin: exp_kernels.triton_exp_rows."""
    f32 = torch.float32
    m, n = tile.k.shape[0], target.shape[0]
    target = torch.cat([target, target.new_full((m - n,), opts.ignore_index)])
    if scales is not None:
        scales = tuple(torch.cat([x, x.new_zeros(m - n)]) for x in scales)
    lse, k_r, u = exp_gemms.lse_of(tile)
    valid, w_y = counted_target_weights(target, class_weight, opts.ignore_index, V, f32)
    eps = opts.label_smoothing
    z_y = tile.zy
    nll = torch.where(valid, w_y * (lse - z_y), 0.0)
    p_y = dft_weight(valid, z_y - lse) if opts.dft else None
    nll = nll if p_y is None else nll * p_y
    W = float(V) if class_weight is None else class_weight.to(f32).sum()
    smooth = torch.where(valid, W * lse - zsum, 0.0) if eps > 0.0 else torch.zeros_like(lse)
    terms = CETerms(lse, nll, smooth, None, None)
    if scales is None:
        return terms, None
    ce_scale, z_scale = scales
    a, b, c = grad_coefficients(ce_scale if p_y is None else ce_scale * p_y, z_scale, w_y,
                                lse, W, V, eps)
    # v = a / S: a e^(k_r ln2 - lse), without 2^k_r's overflow; 0 where a is
    v = torch.where(a == 0.0, 0.0, a * torch.exp(k_r * exp_gemms.LN2 - lse))
    u, uv = exp_gemms.strips(u, v, exp_gemms.tile_n_for(V))
    here = valid & (target >= 0) & (target < V) & (b != 0.0)
    col = torch.where(here, target, -1).long()
    cs = torch.zeros_like(v) if c is None else torch.where(valid, c, 0.0)
    return terms, exp_gemms.ExpGrad(tile.E, u, uv, v, torch.where(here, b, 0.0), col, cs)

"""The policy loss's row math on the exp-GEMM pipeline (loop/exp_gemms.py).

The logits GEMM runs at each token's 1 / T (a tempered ExpTile: z = l / T, y = z log2e),
so p = softmax(z) = E u / S (exp_gemms.merged) and, from the partials alone:
  logprob = ln2 ((y_y - k_r) - log2 S)   (relative to k_r, within half a unit of the row's
            max: exact near the max, as rows.py's (z_y - m) - log s)
  entropy = exp_gemms.entropy_of         (a statistic: see serves)
and for the loss's derivative g of each token's log-prob, dl_c = g ([c == y] - p_c) / T:
an ExpGrad with v = -g / (T S) on the E u term and b = -g / T at the target.
The logits are the GEMM's float32 sums (nothing is rounded before the softmax), so the
log-probs and the gradients are at least as exact as the chunk loop's against float64.
Its Triton twin (the CUDA rows): exp_kernels.triton_policy_exp_rows.
"""

import torch

from ..linear_logprobs import truncation
from ..loop import exp_gemms

# A chunk's bytes per logit: the cross entropy's and the entropy's partial (sum_ey)
BYTES_PER_LOGIT = exp_gemms.BYTES_PER_LOGIT + 4 / 64


def serves(hidden, weight, bias, opts):
    """Whether the pipeline runs this call (else the chunk loop does): no bias, no
    softcap, no truncation, the "fp32" accumulator, operands it takes, and no entropy
    term in the loss (entropy_coef 0): the entropy's gradient has a p_c z_c term that
    the gradient GEMMs' operand transforms (E times a strip) do not form."""
    return (bias is None and opts.softcap is None and opts.entropy_coef == 0.0
            and not truncation.truncating(opts) and opts.accumulator == "fp32"
            and exp_gemms.served(hidden, weight))


def policy_exp_rows(tile, target, valid, inv_t, V, upstream):
    """(logprob, entropy, ExpGrad or None) of a tempered ExpTile of m rows: target, valid,
    inv_t (n,), n <= m, the chunk's tokens (the rows past them are padding); upstream
    (logprob, entropy) of the n tokens -> g (n,), their loss's derivatives (0 where not
    valid), or None for no gradient. logprob and entropy (n,) float32, 0 where not
    valid; a counted target outside [0, V) gives NaN (as rows.finish_stats)."""
    m, n = tile.k.shape[0], target.shape[0]
    k_r, u, S = exp_gemms.merged(tile)
    log2_S = torch.log2(S[:n])
    y_y = tile.zy[:n] * inv_t * exp_gemms.LOG2E  # the epilogue's order: (z t) log2e
    in_range = (target >= 0) & (target < V)
    lp = torch.where(valid, torch.where(
        in_range, exp_gemms.LN2 * ((y_y - k_r[:n]) - log2_S), float("nan")), 0.0)
    ent = torch.where(valid, exp_gemms.entropy_of(tile, k_r, u, S)[:n], 0.0)
    g = upstream(lp, ent)
    if g is None:
        return lp, ent, None
    a = torch.where(valid, -g * inv_t, 0.0)  # an ignored token's T may be anything
    v = a.new_zeros(m)
    v[:n] = torch.where(a == 0.0, 0.0, a / S[:n])
    u, uv = exp_gemms.strips(u, v, exp_gemms.tile_n_for(V))
    here = valid & in_range & (a != 0.0)
    b, col = (x.new_zeros(m) for x in (a, target))
    b[:n] = torch.where(here, a, 0.0)
    col -= 1
    col[:n] = torch.where(here, target, -1)
    return lp, ent, exp_gemms.ExpGrad(tile.E, u, uv, v, b, col.long(), torch.zeros_like(v))

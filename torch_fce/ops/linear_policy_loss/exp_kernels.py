"""The policy loss's row math on the exp-GEMM pipeline in two Triton kernels a chunk.

The twin of exp_rows.policy_exp_rows (same signature, the same terms in the same
order): the PyTorch twin forms a chunk's log-probs, entropies, ExpGrad coefficients and
strips in about 30 small operations (on the GPU each a launch and a pass over (M, T) or
(M,) values). The loss's own per-token formula (`_terms`, autograd on (n,) vectors)
runs between the two kernels, as on the chunk loop:
- _policy_stats_kernel: a sweep of k for k_r = max_t k, a sweep of the partials for S =
  sum_t sum_exp u and the entropy's sum_t (sum_ey + (k - k_r) sum_exp) u (u = 2^(k -
  k_r), exact), then each token's log-prob and entropy;
- _policy_grad_kernel: from the tokens' derivatives g, v = -g / (T S), b and col, and
  the strips (rowmath's _store_strips, bit for bit the twin's).
"""

import torch
import triton
import triton.language as tl

from ..loop import exp_gemms
from ..rowmath.kernels import _pow2, _store_strips

BLOCK_M, BLOCK_T = 16, 128
_LN2 = tl.constexpr(exp_gemms.LN2)
_LOG2E = tl.constexpr(exp_gemms.LOG2E)


@triton.jit
def _policy_stats_kernel(
    sum_exp_ptr, sum_ey_ptr, k_ptr, zy_ptr, target_ptr, valid_ptr, inv_t_ptr,
    k_r_ptr, s_ptr, lp_ptr, ent_ptr, M, n, T, V,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rows [pid BLOCK_M, +BLOCK_M) of a tempered ExpTile of M rows (n of them tokens):
    k_r, S (M,) and the tokens' logprob, entropy (n,), 0 where not valid."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    ts = tl.arange(0, BLOCK_T)
    base = rows.to(tl.int64)[:, None] * T
    k_r = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        mask = live[:, None] & (t0 + ts < T)[None, :]
        k = tl.load(k_ptr + base + t0 + ts[None, :], mask=mask, other=float("-inf"))
        k_r = tl.maximum(k_r, tl.max(k, axis=1))
    S = tl.zeros([BLOCK_M], tl.float32)
    P = tl.zeros([BLOCK_M], tl.float32)  # sum_t (sum_ey + (k - k_r) sum_exp) u
    for t0 in range(0, T, BLOCK_T):
        mask = live[:, None] & (t0 + ts < T)[None, :]
        at = base + t0 + ts[None, :]
        d = tl.load(k_ptr + at, mask=mask, other=0.0) - k_r[:, None]
        se = tl.load(sum_exp_ptr + at, mask=mask, other=0.0)
        sey = tl.load(sum_ey_ptr + at, mask=mask, other=0.0)
        u = tl.where(mask, _pow2(d), 0.0)
        S += tl.sum(se * u, axis=1)
        P += tl.sum(tl.where(mask, (sey + d * se) * u, 0.0), axis=1)
    tl.store(k_r_ptr + rows, k_r, mask=live)
    tl.store(s_ptr + rows, S, mask=live)

    tok = live & (rows < n)
    t = tl.load(target_ptr + rows, mask=tok, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + rows, mask=tok, other=0) != 0
    inv_t = tl.load(inv_t_ptr + rows, mask=tok, other=1.0)
    zy = tl.load(zy_ptr + rows, mask=tok, other=0.0)
    log2_s = tl.log2(S)
    y_y = zy * inv_t * _LOG2E  # the epilogue's order: (z t) log2e
    in_range = (t >= 0) & (t < V)
    lp = tl.where(in_range, _LN2 * ((y_y - k_r) - log2_s), float("nan"))
    tl.store(lp_ptr + rows, tl.where(valid, lp, 0.0), mask=tok)
    tl.store(ent_ptr + rows, tl.where(valid, _LN2 * (log2_s - P / S), 0.0), mask=tok)


@triton.jit
def _policy_grad_kernel(
    k_ptr, k_r_ptr, s_ptr, g_ptr, target_ptr, valid_ptr, inv_t_ptr,
    v_ptr, b_ptr, col_ptr, u_ptr, uv_ptr, M, n, T, V,
    REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Rows [pid BLOCK_M, +BLOCK_M) of the chunk: the tokens' g (n,) -> v, b, col (M,)
    (0, 0, -1 on the padding rows) and the strips u, uv (T REP, M) bf16."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    tok = live & (rows < n)
    g = tl.load(g_ptr + rows, mask=tok, other=0.0)
    t = tl.load(target_ptr + rows, mask=tok, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + rows, mask=tok, other=0) != 0
    inv_t = tl.load(inv_t_ptr + rows, mask=tok, other=1.0)
    S = tl.load(s_ptr + rows, mask=live, other=1.0)
    k_r = tl.load(k_r_ptr + rows, mask=live, other=0.0)
    a = tl.where(valid, -g * inv_t, 0.0)  # an ignored token's T may be anything
    v = tl.where(a == 0.0, 0.0, a / S)
    here = valid & (t >= 0) & (t < V) & (a != 0.0)
    tl.store(v_ptr + rows, v, mask=live)
    tl.store(b_ptr + rows, tl.where(here, a, 0.0), mask=live)
    tl.store(col_ptr + rows, tl.where(here, t, -1), mask=live)
    _store_strips(k_ptr, u_ptr, uv_ptr, rows, live, k_r, v, M, T, REP, BLOCK_T)


def triton_policy_exp_rows(tile, target, valid, inv_t, V, upstream):
    """exp_rows.policy_exp_rows on the Triton kernels (its arguments and results)."""
    M, T = tile.k.shape
    n = target.shape[0]
    f32 = dict(dtype=torch.float32, device=tile.k.device)
    k_r, S = (torch.empty(M, **f32) for _ in range(2))
    lp, ent = (torch.empty(n, **f32) for _ in range(2))
    target, valid, inv_t = (a.contiguous() for a in (target, valid, inv_t))
    grid = (triton.cdiv(M, BLOCK_M),)
    _policy_stats_kernel[grid](
        tile.sum_exp, tile.sum_ey, tile.k, tile.zy, target, valid, inv_t, k_r, S, lp, ent,
        M, n, T, V, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, num_warps=4)
    g = upstream(lp, ent)
    if g is None:
        return lp, ent, None
    rep = exp_gemms.tile_n_for(V) // exp_gemms.STRIP
    v, b = (torch.empty(M, **f32) for _ in range(2))
    col = torch.empty(M, dtype=torch.int64, device=tile.k.device)
    u, uv = (torch.empty(T * rep, M, dtype=torch.bfloat16, device=tile.k.device)
             for _ in range(2))
    _policy_grad_kernel[grid](
        tile.k, k_r, S, g.float().contiguous(), target, valid, inv_t, v, b, col, u, uv,
        M, n, T, V, REP=rep, BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, num_warps=4)
    return lp, ent, exp_gemms.ExpGrad(tile.E, u, uv, v, b, col, torch.zeros_like(v))

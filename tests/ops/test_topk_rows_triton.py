"""The Triton top-k rows (linear_topk_logprobs/kernels.py) against the PyTorch ones
(rows.py): the same classes bit for bit (the tie rule), log-probs within a few
float32 ulps; random rows, low-precision ties, confident rows at large magnitude,
temperature, scale and softcap, padding rows, -0.0, -inf and NaN entries, strided rows,
several blocks, and the bisection forced with small scratch sizes (the interpreter off
the GPU)."""

import math

import pytest
import torch

from torch_fce.ops.linear_topk_logprobs import TopKOptions
from torch_fce.ops.linear_topk_logprobs.rows import topk_rows
from torch_fce.ops.linear_topk_logprobs.kernels import _launch_sizes, triton_topk_rows

from tests.helpers import DEVICE

EPS = torch.finfo(torch.float32).eps


def _opts(k, scale=1.0, cap=None, ignore_index=-100):
    return TopKOptions(k=k, logit_scale=scale, softcap=cap, ignore_index=ignore_index)


def _triton(z, target, inv_t, k, scale=1.0, cap=None, ignore_index=-100, **sizes):
    out = triton_topk_rows(z.to(DEVICE), None if target is None else target.to(DEVICE),
                           inv_t.to(DEVICE), _opts(k, scale, cap, ignore_index),
                           torch.float32, **sizes)
    return [t.cpu() for t in out]


def _u(z, inv_t, scale, cap):
    u = z.float() * scale
    if cap is not None:
        u = torch.tanh(u / cap) * cap
    return u * inv_t[:, None]


def _overflows(u, k, G, C):
    """Whether the classes at or above the kernel's first threshold (recomputed) pass C
    slots: the ordered compaction and the bisection run."""
    u = torch.where(u.isnan(), -math.inf, u)
    n, V = u.shape
    pad = torch.full((n, -V % G), -math.inf)
    group = torch.cat([u, pad], 1).reshape(n, -1, G).amax(1)
    t = group.sort(-1, descending=True).values[:, k - 1:k]
    gt, eq = (u > t).sum(-1), (u == t).sum(-1)
    return gt + eq > C


def check(z, k, target=None, inv_t=None, scale=1.0, cap=None, ignore_index=-100,
          groups=None, slots=None, expect_overflow=None):
    n, V = z.shape
    inv_t = torch.ones(n) if inv_t is None else inv_t
    ref_i, ref_lp, ref_tlp = topk_rows(z.clone(), target, inv_t,
                                       _opts(k, scale, cap, ignore_index), torch.float32)
    idx, lp, tlp = _triton(z, target, inv_t, k, scale, cap, ignore_index, groups=groups,
                           slots=slots)
    assert idx.dtype == torch.int64 and lp.dtype == tlp.dtype == torch.float32
    assert torch.equal(idx, ref_i)
    # (u - m) - log s against u - (m + log s): a few ulps of the larger of u and lse
    u = _u(z, inv_t, scale, cap)
    lse = torch.logsumexp(u, -1, keepdim=True)
    tol = 8 * EPS * (u.gather(1, idx).abs() + lse.abs())
    finite = torch.isfinite(ref_lp)
    assert torch.equal(finite, torch.isfinite(lp))
    assert torch.equal(lp[~finite].nan_to_num(), ref_lp[~finite].nan_to_num())
    assert ((lp - ref_lp).abs()[finite] <= tol[finite]).all()
    ttol = 8 * EPS * (lse[:, 0].abs() + 1.0)
    if target is not None:
        y_u = u.gather(1, target.clamp(0, V - 1)[:, None])[:, 0].abs()
        ttol = ttol + 8 * EPS * y_u
    ok = torch.isclose(tlp, ref_tlp, rtol=0, atol=0, equal_nan=True) \
        | ((tlp - ref_tlp).abs() <= ttol)
    assert ok.all()
    if expect_overflow is not None:
        _, _, G, C = _launch_sizes(V, k)
        assert bool(_overflows(u, k, groups or G, slots or C).any()) == expect_overflow


def randn(n, V, seed=0, dtype=torch.float32):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("V,k", [(1001, 1), (1001, 8), (257, 256), (257, 257),
                                 (3000, 256), (5, 5), (130, 3)])
def test_random(V, k):
    z = randn(4, V, seed=V + k)
    target = torch.tensor([0, V - 1, -100, V // 2])
    check(z, k, target=target, expect_overflow=False)


@pytest.mark.parametrize("V,k", [(1, 1), (2, 1), (2, 2)])
def test_tiny_rows(V, k):
    check(randn(3, V, seed=13), k, target=torch.tensor([0, V - 1, -100]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_ties(dtype):
    # bf16 rounding of N(0, 1) * 3 - 20: many exact ties around the k-th value
    z = (randn(3, 2500, seed=1) * 3 - 20).to(dtype)
    assert len(z[0].unique()) < 1000
    for k in (1, 7, 64, 256):
        check(z, k, target=torch.arange(3) * 800)


def test_confident_rows_large_magnitude():
    z = randn(3, 2000, seed=2) * 100
    z[1, 17] = 5000.0  # one class holds all the mass
    check(z, 16, target=torch.tensor([17, 17, 3]))


def test_temperature_scale():
    z = randn(5, 1500, seed=3, dtype=torch.bfloat16)
    inv_t = torch.tensor([1.0, 0.5, 2.0, 1 / 0.7, 10.0])
    check(z, 32, target=torch.arange(5), inv_t=inv_t, scale=0.37)


def test_softcap():
    z = randn(4, 1200, seed=4) * 20
    check(z, 50, target=torch.tensor([1, 2, -100, 4]), inv_t=torch.full((4,), 0.8),
          scale=1.5, cap=30.0)


def test_equal_rows():
    # padding rows: every class ties, more than the slots: the ordered compaction keeps
    # the k lowest classes, a tie at the bound (it ends there, without bisection)
    z = torch.zeros(3, 2049, dtype=torch.bfloat16)
    z[1] = -7.0
    check(z, 256, target=torch.tensor([0, 5, -100]), expect_overflow=True)
    check(z, 1, expect_overflow=True)


def test_negative_zero():
    z = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0, -1.0]] * 2)
    z[1] = -z[1]
    check(z, 5)


def test_minus_inf():
    z = randn(4, 1000, seed=5)
    z[0, ::3] = -math.inf
    z[1, 10:] = -math.inf  # 10 finite classes, k = 20
    z[2] = -math.inf  # all: NaN log-probs, the k lowest classes
    z[3, :500] = -math.inf
    check(z, 20, target=torch.tensor([0, 3, 7, 9]))


def test_nan_row():
    # selection ranks NaN as -inf; the row's log-probs are NaN (no hang)
    z = randn(2, 700, seed=6)
    z[0, 5] = math.nan
    z[0, 100:] = math.nan
    idx, lp, tlp = _triton(z, torch.tensor([1, 2]), torch.ones(2), 120)
    ref_i, _, _ = topk_rows(torch.where(z.isnan(), -math.inf, z), None, torch.ones(2),
                            _opts(120), torch.float32)
    assert torch.equal(idx, ref_i)
    assert lp[0].isnan().all() and tlp[0].isnan() and not lp[1].isnan().any()


def test_row_stride():
    wide = randn(6, 1800, seed=7, dtype=torch.bfloat16)
    z = wide[::2, 100:1100]  # rows of a wider buffer, every other one
    assert z.stride() == (3600, 1)
    check(z, 40, target=torch.tensor([0, 999, 500]))


def test_multiple_blocks():
    # V past BLOCK_V (4096): lanes see several blocks, the compaction several scans
    z = randn(2, 9000, seed=8, dtype=torch.bfloat16)
    check(z, 100, target=torch.tensor([8999, 4096]), expect_overflow=False)


def test_ties_across_lanes():
    # the scratch holds the candidates lane by lane (class mod 4096), not in class
    # order: ties at the k-th value in several blocks, more than k of them, kept by
    # ascending class
    z = randn(2, 9000, seed=13) - 8.0
    tied = torch.tensor([8000, 5, 4100, 100, 4097, 8193, 3, 6000, 4101, 200, 8999, 7])
    z[:, tied] = 2.0
    z[0, [4500, 9, 8100]] = 3.0  # 3 above them
    check(z, 6, expect_overflow=False)
    check(z.to(torch.bfloat16), 10, expect_overflow=False)


def test_many_segments_and_gather_steps():
    # more segments than a listing step reads and more hit segments than a gather step
    # takes (linear_topk_logprobs/kernels.py: _SEGMENT, _STEP), the last segment partial. Row 1:
    # k of its candidates early, the largest class in the last segment (a listing that
    # stops early still counts k and answers wrong, not through the exact fallback)
    z = randn(2, 40001, seed=13)
    z[1] *= 0.1
    z[1, 0:5000:20] = 3.0 + randn(1, 250, seed=14)[0] * 0.01
    z[1, 40000] = 7.0
    check(z, 200, target=torch.tensor([40000, 997]), expect_overflow=False)
    # k = 8: about a hundred segments hold a class above the bound, 40 of them ties
    z = randn(1, 40001, seed=15) * 0.1
    z[0, 0:1280:32] = 3.0
    z[0, 40000] = 7.0
    check(z, 8, expect_overflow=False)


def test_blocks_without_candidates():
    # the largest classes in the first block: later blocks only count
    z = randn(1, 20000, seed=12, dtype=torch.bfloat16)
    z[0, 100:103] = 9.0
    z[0, 150] = 8.0
    check(z, 3, target=torch.tensor([150]), expect_overflow=False)


def test_out_of_range_target_is_nan():
    for rows in (_triton, lambda z, y, inv_t, k: topk_rows(z, y, inv_t, _opts(k),
                                                            torch.float32)):
        _, _, tlp = rows(randn(2, 300), torch.tensor([300, -1]), torch.ones(2), 4)
        assert tlp.isnan().all()


def _striped(n, V, G, seed):
    """Rows whose largest values share one group (classes = 0 mod G): the group bound
    is loose, sweep 2 overflows."""
    z = randn(n, V, seed=seed)
    z[:, ::G] += 10.0
    return z


@pytest.mark.parametrize("k,slots", [(4, 8), (8, 16), (5, 16)])
def test_bisection(k, slots):
    z = _striped(3, 2048, 128, seed=k)
    check(z, k, target=torch.tensor([0, 128, 1]), groups=128, slots=slots,
          expect_overflow=True)


def test_bisection_ends_on_ties():
    # the k-th value tied beyond C: the bisection ends at lo = hi = v_k
    z = _striped(3, 2048, 128, seed=9).to(torch.bfloat16)
    z[0, ::128] = 10.0  # 16 ties at the top, k = 4
    z[1, ::128] = 10.0
    z[1, 0:384:128] = torch.tensor([13.0, 12.0, 11.0])  # 3 above, 13 ties
    z[2, ::128] = 10.0
    z[2, 128] = 10.5  # 1 above, 15 ties
    check(z, 4, groups=128, slots=8, expect_overflow=True)


def test_bisection_minus_inf_bound():
    # fewer than k groups finite: t = -inf, overflowing through the finite classes
    z = torch.full((2, 1500), -math.inf)
    z[:, ::128] = randn(2, 12, seed=10)
    z[1, 0:600:128] = 2.0  # ties among them
    check(z, 4, groups=128, slots=8, expect_overflow=True)


def test_forced_overflow_random_rows():
    # small C and G on random bf16 rows: some rows take the bisection, all exact
    z = randn(8, 3000, seed=11, dtype=torch.bfloat16)
    check(z, 16, target=torch.arange(8), groups=16, slots=32, expect_overflow=True)


@pytest.mark.parametrize("seed", range(16))
def test_fuzz_ties(seed):
    # values on a grid of 1/4 (ties), some -inf and -0.0, one row striped, and the
    # smallest G and C: sweep 2 fits or overflows, ends on ties or not
    gen = torch.Generator().manual_seed(seed)
    V = int(torch.randint(2, 700, (), generator=gen))
    k = int(torch.randint(1, min(V, 40) + 1, (), generator=gen))
    z = torch.randint(-40, 40, (4, V), generator=gen) / 4.0
    z[0, torch.randint(0, V, (V // 3,), generator=gen)] = -math.inf
    z[1, torch.randint(0, V, (V // 3,), generator=gen)] = -0.0
    kk = 1 << (k - 1).bit_length()
    G = max(kk, 2) << int(torch.randint(0, 2, (), generator=gen))
    z[2, ::G] += 12.0
    C = max(1 << (2 * k - 2).bit_length(), 2)
    check(z.to(torch.bfloat16), k, target=torch.randint(0, V, (4,), generator=gen),
          groups=min(G, max(1 << (V - 1).bit_length(), 128)), slots=C)

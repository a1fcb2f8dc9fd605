"""The loop's sparse logits gradient (torch_fce/ops/loop/sparse.py): the hidden, weight
and bias gradients formed from (n, K) entries against the float64 products of the dense
dz they stand for, on the PyTorch path and on the Triton kernels (the interpreter off
the GPU): duplicate entries, zero entries, a class named by more entries than a kernel
step takes, classes named by none, D over several blocks, no tokens; and the sparse
divergence without the tail runs no gradient GEMM."""

import pytest
import torch

import torch_fce
from torch_fce.ops.loop.sparse import SparseGrad, products
from torch_fce.testing import rel_err

from tests.helpers import DEVICE, EPS


def _entries(N, K, V, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    cols = torch.randint(0, V - 1, (N, K), generator=g)  # class V - 1: no entry
    cols[:, 0] = 5  # one class in every token: more entries than a kernel step
    cols[:, 2] = cols[:, 1]  # duplicates within a row
    vals = torch.randn(N, K, generator=g, dtype=torch.float64)
    vals[3] = 0.0  # a token without gradient
    mdt = torch.float64 if dtype == torch.float64 else torch.float32
    return cols.to(DEVICE), vals.to(mdt).to(DEVICE)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_products_equal_the_dense_gradients(impl, dtype):
    N, K, V, D = 40, 4, 13, 37
    cols, vals = _entries(N, K, V, 1, dtype)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, D, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(V, D, generator=g).to(dtype).to(DEVICE)
    dz = torch.zeros(N, V, dtype=torch.float64, device=DEVICE).scatter_add_(1, cols,
                                                                            vals.double())
    want = (dz @ w.double(), dz.T @ h.double(), dz.sum(0))
    wide = torch.promote_types(dtype, torch.float32)
    got = products(SparseGrad(cols, vals), h, w, [True, True, True],
                   torch.empty(N, D, dtype=dtype, device=DEVICE), wide, triton=impl == "triton")
    assert [t.dtype for t in got] == [dtype, wide, vals.dtype]
    # each a float32 (float64) sum rounded once into its dtype
    work = EPS[wide] * 8
    for name, a, r, tol in zip(("hidden", "weight", "bias"), got, want,
                               (max(EPS[dtype], work), work, work)):
        assert rel_err(a.double(), r) <= tol, name
    assert torch.equal(got[1][V - 1], torch.zeros(D, dtype=wide, device=DEVICE))
    assert got[2][V - 1] == 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_products_of_some_gradients_and_of_no_tokens(impl):
    N, K, V, D = 20, 3, 9, 5
    cols, vals = _entries(N, K, V, 3, torch.float32)
    h, w = torch.randn(N, D).to(DEVICE), torch.randn(V, D).to(DEVICE)
    dz = torch.zeros(N, V, device=DEVICE).scatter_add_(1, cols, vals)
    gh, gw, gb = products(SparseGrad(cols, vals), h, w, [False, False, True], None,
                          torch.float32, triton=impl == "triton")
    assert gh is None and gw is None and rel_err(gb, dz.sum(0)) <= 1e-6
    gh, gw, gb = products(SparseGrad(cols, vals), h, w, [False, True, False], None,
                          torch.bfloat16, triton=impl == "triton")
    assert gb is None and gw.dtype == torch.bfloat16
    assert rel_err(gw.float(), dz.T @ h) <= EPS[torch.bfloat16]
    none = SparseGrad(cols[:0], vals[:0])
    gh, gw, gb = products(none, h[:0], w, [True, True, True], h[:0].clone(),
                          torch.float32, triton=impl == "triton")
    assert gh.shape == (0, D) and not gw.any() and not gb.any()


# on CUDA the loop runs the Triton products whatever the rows (float64 too:
# dispatch.Backend.sums); torch's index_add there uses atomics
@pytest.mark.parametrize("impl", ["triton"] + (["torch"] if DEVICE != "cuda" else []))
def test_identical_calls_give_identical_bits(impl):
    N, K, V, D = 64, 8, 7, 24  # every class named by many entries, in token order
    cols, vals = _entries(N, K, V, 4, torch.float32)
    h, w = torch.randn(N, D).to(DEVICE), torch.randn(V, D).to(DEVICE)
    runs = [products(SparseGrad(cols, vals), h, w, [True, True, True],
                     torch.empty(N, D, device=DEVICE), torch.float32,
                     triton=impl == "triton") for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _gemms(fn):
    """The matrix products a call runs (the profiler's aten::mm / addmm events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("tail", [False, True])
def test_the_divergence_without_the_tail_runs_no_gradient_gemm(tail):
    # without the tail the gradient comes from the support's entries alone: a call with
    # gradients runs the forward's logits GEMMs and no more (with the tail: more)
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(300, 16, generator=g), torch.randn(50, 16, generator=g)
    support = torch.randint(0, 50, (300, 4), generator=g)
    lp = torch.randn(300, 4, generator=g).log_softmax(-1) - 0.1

    def run(grad):
        leaves = [h.clone().requires_grad_(grad), w.clone().requires_grad_(grad)]
        return lambda: torch_fce.linear_sparse_divergence(*leaves, support, lp, tail=tail)

    with_grad, without = _gemms(run(True)), _gemms(run(False))
    assert without > 0
    assert (with_grad == without) == (not tail)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_an_entry_of_value_zero_adds_nothing_whatever_its_rows_hold(impl):
    # a token without gradient whose hidden row is not finite, and a weight row that only
    # zero-valued entries name: the gradients as with those rows 0
    N, K, V, D = 6, 3, 5, 4
    g = torch.Generator().manual_seed(7)
    cols = torch.randint(0, V - 1, (N, K), generator=g)
    vals = torch.randn(N, K, generator=g)
    vals[2] = 0.0
    cols[2, 0] = V - 1  # the weight row only a zero-valued entry names
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    bad_h, bad_w = h.clone(), w.clone()
    bad_h[2], bad_w[V - 1] = float("inf"), float("nan")
    grad = SparseGrad(cols.to(DEVICE), vals.to(DEVICE))
    clean, bad = (products(grad, a.to(DEVICE), b.to(DEVICE), [True, True, True],
                           torch.empty(N, D, device=DEVICE), torch.float32, triton=impl == "triton")
                  for a, b in ((h, w), (bad_h, bad_w)))
    for a, b in zip(clean, bad):
        assert torch.equal(a, b)

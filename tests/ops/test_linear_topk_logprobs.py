"""linear_topk_logprobs against a float64 reference (a full stable sort of each row's
log-softmax): every option, ties (rows of equal logits, the k-th value shared), k = 1
and k = V, odd V, confident rows at large magnitude, ignored targets, several chunks;
compile; bad input named; nothing differentiated, nothing modified."""

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.ops import linear_topk_logprobs as room
from torch_fce.testing import rel_err

from tests.helpers import DEVICE, ONE_DEVICE, TORCH, TRITON, chunks, confident_inputs
from tests.references import topk_reference as reference


@st.composite
def problems(draw):
    N, D = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    V = draw(st.sampled_from([1, 2, 7, 37, 61]))
    k = draw(st.integers(1, min(V, 8)) | st.just(V))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = torch.randn(N, D, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 6.0]))
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    if draw(st.booleans()):  # exact ties: repeated classes (equal logits)
        w[V // 2:] = w[:V - V // 2].clone()
    b = torch.randn(V, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    if b is not None and draw(st.booleans()):
        b[V // 2:] = b[:V - V // 2].clone()
        w[V // 2:] = w[:V - V // 2].clone()
    t = torch.randint(0, V, (N,), generator=g)
    t[::3] = -100
    T = draw(st.sampled_from([1.0, 0.7, "tensor"]))
    if T == "tensor":
        T = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    options = dict(softcap=draw(st.sampled_from([None, 3.0])),
                   logit_scale=draw(st.sampled_from([1.0, 0.5])))
    return dict(h=h, w=w, b=b, t=t, k=k, T=T, options=options,
                target=draw(st.booleans()), rows=draw(st.sampled_from([None, 2])))


def _dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


@given(problems())
def test_matches_the_float64_reference_ties_included(p):
    h, w, b, t, T = (_dev(p[k]) for k in ("h", "w", "b", "t", "T"))
    target = t if p["target"] else None
    want = reference(h, w, p["k"], b, target, T, **p["options"])
    run = lambda: torch_fce.linear_topk_logprobs(h, w, p["k"], b, target=target,  # noqa: E731
                                                 temperature=T, **p["options"])
    if p["rows"]:
        with chunks(p["rows"], h, w):
            got = run()
    else:
        got = run()
    assert got.indices.dtype == torch.int64 and got.indices.shape == (h.shape[0], p["k"])
    assert torch.equal(got.indices, want[0])  # float64: the order itself, ties by class
    assert rel_err(got.logprobs, want[1]) <= 1e-12
    if target is None:
        assert got.target_logprob is None
    else:
        assert rel_err(got.target_logprob, want[2]) <= 1e-12


@given(problems(), st.sampled_from([1, 3, 64]), st.sampled_from([torch.float32, None]))
def test_triton_rows_equal_the_pytorch_rows(p, rows, logits_dtype):
    # float32 inputs (the interpreter off the GPU): the same classes, ties included, and
    # the same log-probs to float32's rounding, per chunk size
    h, w, b = (None if p[k] is None else p[k].float().to(DEVICE) for k in ("h", "w", "b"))
    N = h.shape[0]
    target = p["t"].to(DEVICE) if p["target"] else None
    T = torch.as_tensor(p["T"], dtype=torch.float32).expand(N).contiguous().to(DEVICE)
    rec = room.TopKOptions(k=p["k"], logits_dtype=logits_dtype, **p["options"])
    with chunks(rows, h, w):
        got, want = (room.fwd(h, w, b, target, T, *rec, *ONE_DEVICE, backend=backend)
                     for backend in (TRITON, TORCH))
    assert torch.equal(got[0], want[0])
    scale = 1e-5 * (1 + want[1].abs().max())
    assert (got[1] - want[1]).abs().max() <= scale
    assert (got[2] - want[2]).abs().max() <= scale


def test_float32_confident_rows_at_large_magnitude_and_batch_shape():
    h, w, _ = (x.to(DEVICE) for x in confident_inputs(48, 24, 257, offset=50.0))
    h3 = h.reshape(4, 12, 24)
    got = torch_fce.linear_topk_logprobs(h3, w, 5)
    idx, lp, _ = reference(h, w, 5)
    assert got.indices.shape == (4, 12, 5)
    assert torch.equal(got.indices.reshape(48, 5), idx)
    # float32 logits against float64: within float32's rounding of the row's logsumexp
    assert (got.logprobs.reshape(48, 5).double() - lp).abs().max() <= 1e-4


def test_shift_no_gradient_and_inputs_unchanged():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 8, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(11, 8, generator=g).to(DEVICE).requires_grad_()
    y = torch.randint(0, 11, (2, 5), generator=g).to(DEVICE)
    before = [x.clone() for x in (h, w, y)]
    got = torch_fce.linear_topk_logprobs(h, w, 3, target=y, shift=True)
    assert not got.logprobs.requires_grad and not got.target_logprob.requires_grad
    want = reference(h.detach(), w.detach(), 3, target=torch.cat(
        [y[:, 1:], torch.full((2, 1), -100, device=DEVICE)], 1))
    assert rel_err(got.target_logprob.double(), want[2]) <= 1e-6
    assert (got.target_logprob[:, -1] == 0).all()  # the last position: no next token
    assert all(torch.equal(a, b) for a, b in zip((h, w, y), before))


def test_compiled_fullgraph_dynamic_equals_eager():
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 8, generator=g).to(DEVICE), torch.randn(29, 8, generator=g).to(DEVICE)
    y = torch.randint(0, 29, (9,), generator=g).to(DEVICE)

    def fn(h, w, y):
        return torch_fce.linear_topk_logprobs(h, w, 4, target=y, temperature=0.8)

    eager, compiled = fn(h, w, y), torch.compile(fn, fullgraph=True, dynamic=True)(h, w, y)
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)


@pytest.mark.parametrize("backend", ["torch_rows", "triton_rows"])
def test_a_row_of_nan_gives_nan_logprobs_and_leaves_the_others(backend):
    # a NaN hidden state (a diverged step): its row's log-probs are NaN, no index is out
    # of bounds, the other rows are as without it
    from tests.helpers import BACKENDS, nan_row_inputs

    h, bad, w, y, keep = nan_row_inputs(1, seed=9)
    opts = room.TopKOptions(k=5)

    def run(h):
        return room.fwd(h, w, None, y, torch.ones(4, device=DEVICE), *opts,
                        *ONE_DEVICE, backend=BACKENDS[backend])

    clean, got = run(h), run(bad)
    assert got[1][1].isnan().all() and got[2][1].isnan()
    assert (got[0][1] >= 0).all() and (got[0][1] < 23).all()
    for a, b in zip(got, clean):
        assert torch.equal(a[keep], b[keep])


def test_opcheck():
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(6, 4, generator=g), torch.randn(13, 4, generator=g), None,
            torch.randint(0, 13, (6,), generator=g), None)
    torch.library.opcheck(torch.ops.fce.linear_topk_logprobs_fwd.default,
                          args + (3, 1.0, None, -100, None, *ONE_DEVICE))


@pytest.mark.parametrize("args, options, error, named", [
    ((torch.randn(3, 4), torch.randn(5, 4), 6), {}, ValueError, "k must be at most"),
    ((torch.randn(3, 4), torch.randn(500, 4), 257), {}, ValueError, "k must be in"),
    ((torch.randn(3, 4), torch.randn(5, 4), 0), {}, ValueError, "k must be in"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2.0), {}, TypeError, "k must be an int"),
    ((torch.randn(3, 4), torch.randn(5, 3), 2), {}, ValueError, "weight"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2), dict(logit_scale=0.0), ValueError,
     "logit_scale"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2), dict(target=torch.zeros(3)), TypeError,
     "target"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2), dict(shift=True), ValueError, "shift"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2), dict(temperature=0.0), ValueError,
     "temperature"),
    ((torch.randn(3, 4), torch.randn(5, 4), 2), dict(temperature=torch.ones(5)), ValueError,
     "temperature .*hidden's leading shape"),
])
def test_bad_input_is_named(args, options, error, named):
    with pytest.raises(error, match=named):
        torch_fce.linear_topk_logprobs(*args, **options)


def test_integral_numbers_are_ints():
    # numpy's integers (a config's, an array's) are ints to every public function
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(8)
    h, w = torch.randn(3, 4, generator=g), torch.randn(9, 4, generator=g)
    t = torch.randint(0, 9, (3,), generator=g)
    assert torch.equal(torch_fce.linear_topk_logprobs(h, w, np.int64(3)).indices,
                       torch_fce.linear_topk_logprobs(h, w, 3).indices)
    for fn in (lambda k: torch_fce.linear_logprobs(h, w, t, top_k=k).logprob,
               lambda k: torch_fce.linear_policy_loss(h, w, t, torch.ones(3), top_k=k)[0],
               lambda k: torch_fce.linear_cross_entropy(h, w, t, ignore_index=k - 103)):
        assert torch.equal(fn(np.int32(3)), fn(3))


@pytest.mark.cuda
def test_on_cuda_has_no_host_sync():
    from tests.helpers import no_host_sync

    g = torch.Generator().manual_seed(7)
    h = torch.randn(64, 32, generator=g).bfloat16().cuda()
    w = torch.randn(509, 32, generator=g).bfloat16().cuda()
    t = torch.randint(0, 509, (64,), generator=g).cuda()
    with no_host_sync():
        got = torch_fce.linear_topk_logprobs(h, w, 16, target=t, temperature=0.9)
    want = reference(h.double(), w.double(), 16, None, t, 0.9)
    # float32 logits (the default) against float64: near-ties may swap, the log-probs
    # agree
    assert (got.logprobs.double() - want[1]).abs().max() <= 1e-4
    assert (got.target_logprob.double() - want[2]).abs().max() <= 1e-4

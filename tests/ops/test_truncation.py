"""The sampler's truncation (top_k, top_p, min_p) in linear_logprobs and
linear_policy_loss against a float64 reference written from vLLM's rules
(tests/references.sampler_kept): ties at the k-th value (equal weight rows give equal
logits), top_p reached exactly, min_p with several maxima, all three together, top_k >= V,
top_p = 1, targets outside the kept set, softcap, temperatures, odd V, chunks and
vocabulary tiles; the Triton top-k candidates under the interpreter; gradcheck; compile;
bad values named."""

import functools
import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.ops import linear_logprobs as room
from torch_fce.ops.linear_logprobs.truncation_rows import TORCH_TRUNCATION_ROWS
from torch_fce.ops.loop.chunked import ONE_DEVICE

from tests.helpers import DEVICE, TORCH, TRITON, chunks
from tests.references import logprobs_reference, policy_reference, sampler_kept


@st.composite
def problems(draw):
    N, D = draw(st.integers(1, 8)), draw(st.integers(1, 5))
    V = draw(st.sampled_from([2, 7, 37, 61]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = torch.randn(N, D, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 3.0]))
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    if draw(st.booleans()):  # equal rows: ties in every token's logits
        w[torch.randint(0, V, (V // 2,), generator=g)] = w[0].clone()
    b = torch.randn(V, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    target = torch.randint(0, V, (N,), generator=g)
    if draw(st.booleans()):  # some targets surely kept: each row's most likely class
        z = h @ w.T + (0 if b is None else b)
        target = torch.where(torch.rand(N, generator=g) < 0.5, z.argmax(-1), target)
    target[torch.rand(N, generator=g) < 0.2] = -100
    T = draw(st.sampled_from([1.0, 0.7, "tensor"]))
    if T == "tensor":
        T = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    truncation = dict(top_k=draw(st.sampled_from([None, 1, 3, V, V + 5])),
                      top_p=draw(st.sampled_from([None, 0.3, 0.9, 1.0])),
                      min_p=draw(st.sampled_from([None, 0.0, 0.2, 1.0])))
    return dict(h=h, w=w, b=b, target=target, T=T, softcap=draw(st.sampled_from([None, 3.0])),
                truncation=truncation, rows=draw(st.sampled_from([None, 1, 3])))


def _grads(outputs, leaves, seed=0):
    """Gradients of a random combination of the finite log-probs and the entropies."""
    g = torch.Generator().manual_seed(seed)
    lp, ent = outputs
    cl = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(lp)
    ce = torch.randn(ent.shape, generator=g, dtype=torch.float64).to(ent)
    total = (torch.where(lp > -math.inf, lp, 0.0) * cl).sum() + (ent * ce).sum()
    return torch.autograd.grad(total, leaves)


@given(problems())
def test_logprobs_match_the_float64_reference_of_vllms_rules(p):
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    leaves = [dev[k].clone().requires_grad_() for k in ("h", "w", "b") if dev[k] is not None]
    kw = dict(temperature=dev["T"], softcap=p["softcap"], **p["truncation"])

    def ours():
        out = torch_fce.linear_logprobs(*leaves[:2], dev["target"], *leaves[2:], entropy=True,
                                        **kw)
        return out.logprob, out.entropy, out.lse

    if p["rows"]:
        with chunks(p["rows"], leaves[0], leaves[1]):
            got = ours()
            got_g = _grads(got[:2], leaves)
    else:
        got = ours()
        got_g = _grads(got[:2], leaves)
    want = logprobs_reference(*leaves[:2], dev["target"], *leaves[2:], **kw)
    want_g = _grads(want[:2], leaves)
    for name, a, r in zip(("logprob", "entropy", "lse"), got, want[:3]):
        assert torch.equal(a == -math.inf, r == -math.inf), name  # the same kept targets
        a, r = (torch.where(r == -math.inf, 0.0, x) for x in (a, r))
        assert (a - r).abs().max() <= 1e-10 * (1 + r.abs().max()), name
    for a, r in zip(got_g, want_g):
        assert (a - r).norm() <= 1e-9 * (1 + r.norm())


def test_the_rules_boundaries():
    # four equal logits: top_p 0.5 is reached exactly by the two lowest classes; with a
    # fifth class below them min_p 1 keeps every maximum, top_k 3 the three lowest
    h = torch.ones(1, 1, dtype=torch.float64)

    def kept(w, **kw):
        w = torch.tensor(w, dtype=torch.float64)[:, None]
        return {c for c in range(len(w)) if torch_fce.linear_logprobs(
            h, w, torch.tensor([c]), **kw).logprob.item() > -math.inf}

    flat = [1.0, 1.0, 1.0, 1.0]
    assert kept(flat, top_p=0.5) == {0, 1} and kept(flat, top_p=0.51) == {0, 1, 2}
    assert kept(flat, top_p=1e-9) == {0}  # the most likely class always
    assert kept(flat, top_k=9, top_p=1.0, min_p=0.0) == {0, 1, 2, 3}
    five = [1.0, 0.0, 1.0, 1.0, 1.0]
    assert kept(five, min_p=1.0) == {0, 2, 3, 4} and kept(five, top_k=3) == {0, 2, 3}
    assert kept(five, top_k=4, min_p=0.5, top_p=0.5) == {0, 2}
    assert sampler_kept(torch.tensor([flat]), top_p=0.5)[0].nonzero().flatten().tolist() \
        == [0, 1]  # the reference agrees
    out = torch_fce.linear_logprobs(h, torch.tensor(flat, dtype=torch.float64)[:, None],
                                    torch.tensor([1]), top_p=0.5, entropy=True)
    assert torch.allclose(out.logprob, torch.tensor([math.log(0.5)], dtype=torch.float64))
    assert torch.allclose(out.entropy, torch.tensor([math.log(2.0)], dtype=torch.float64))


@pytest.mark.parametrize("truncation", [dict(top_k=5), dict(top_k=4, top_p=0.8, min_p=0.05),
                                        dict(top_p=0.8), dict(top_p=0.9, min_p=0.05),
                                        dict(min_p=0.2)])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("rows", [1, 4])
def test_triton_rows_match_the_float64_reference(truncation, softcap, rows):
    # float32 inputs on the Triton rows (the interpreter off the GPU: the top-k kernel's
    # candidates, their z gathered, or without a top-k the threshold sweeps; the
    # gradient sweep's kept-set test), a tie in every row, forward and backward (token
    # chunks, and vocabulary tiles with rows = 1)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, generator=g).to(DEVICE)
    w = torch.randn(29, 8, generator=g).to(DEVICE)
    w[7] = w[3]
    y = torch.randint(0, 29, (6,), generator=g).to(DEVICE)
    y[:3] = (h[:3] @ w.T).argmax(-1)
    T = torch.full((6,), 0.8, device=DEVICE)
    opts = room.LogProbOptions(softcap=softcap, entropy=True, **truncation)
    with chunks(rows, h, w):
        lp, ent, lse, _, stats = room.fwd(h, w, y, None, T, *opts, *ONE_DEVICE,
                                          backend=TRITON)
        gl, ge = torch.randn(6, generator=g).to(DEVICE), torch.randn(6, generator=g).to(DEVICE)
        gh, gw, _ = room.bwd(gl, ge, stats, h, w, y, None, T, *opts, *ONE_DEVICE,
                             [True, True, False], backend=TRITON)
    leaves = [h.double().requires_grad_(), w.double().requires_grad_()]
    want = logprobs_reference(*leaves, y, temperature=0.8, softcap=softcap, **truncation)
    assert torch.equal(lp == -math.inf, want[0] == -math.inf)
    kept = want[0] > -math.inf
    assert (lp[kept].double() - want[0][kept]).abs().max() <= 1e-5
    assert (ent.double() - want[1]).abs().max() <= 1e-5
    assert (lse.double() - want[2]).abs().max() <= 1e-5
    objective = ((torch.where(kept, want[0], 0.0) * gl.double()).sum()
                 + (want[1] * ge.double()).sum())
    for a, r in zip((gh, gw), torch.autograd.grad(objective, leaves)):
        assert (a.double() - r).abs().max() <= 1e-5 * (1 + r.abs().max())


def _threshold_rows_problem():
    """Rows (n, 3000) of every regime the threshold sweeps meet: flat to confident
    (scales 0.3 to 4: K of thousands of classes to a few), bf16-rounded and half-integer
    rows (ties at the boundary), an all-equal row and one with a single larger class
    (ties only), -inf and -0.0 entries, a large magnitude, four finite classes (top_p
    0.5 reached exactly after two); per-row temperatures; targets the argmax, random,
    ignored and out of range."""
    g = torch.Generator().manual_seed(21)
    V = 3000
    z = torch.randn(13, V, generator=g) * torch.tensor(
        [0.3, 1.0, 4.0, 0.3, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 30.0, 1.0])[:, None]
    z[3:6] = z[3:6].bfloat16().float()
    z[6] = (z[6] * 2).round() / 2
    z[7] = 0.0
    z[8] = 0.0
    z[8, 2999] = 1.0
    z[9, ::7] = -math.inf
    z[9, 1::7] = -0.0
    z[10] += 1e4
    z[12] = -math.inf
    z[12, [5, 700, 701, 2999]] = 5.0
    inv_t = torch.rand(13, generator=g) + 0.5
    inv_t[12] = 1.0
    y = torch.randint(0, V, (13,), generator=g)
    y[:4] = z[:4].argmax(-1)
    y[4], y[5] = -100, V + 3
    return z.to(DEVICE), y.to(DEVICE), inv_t.to(DEVICE)


def _assert_outputs_match(got, want):
    """kept_stats' log-probs, entropies and lse alike (NaN and -inf at the same rows,
    finite ones within float32 rounding), the argmax equal."""
    for name, a, r in zip(("logprob", "entropy", "lse"), got, want):
        assert torch.equal(a.isnan(), r.isnan()) and torch.equal(a == -math.inf,
                                                                 r == -math.inf), name
        ok = torch.isfinite(r)
        assert ((a - r).abs()[ok] <= 1e-5 * (1 + r.abs()[ok])).all(), name
    assert torch.equal(got[3], want[3])  # argmax


def _sorted_rows():
    """The PyTorch truncation rows with the whole row sorted (no threshold search)."""
    return TORCH_TRUNCATION_ROWS._replace(thresholds=None)


_TRUNCATIONS = [dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.5, min_p=0.02),
                dict(top_p=0.999), dict(top_p=0.01), dict(min_p=0.1),
                dict(top_p=0.7, top_k=5000)]


# the kernel's own sizes on four cases (4 s each in the interpreter); on all, 8 slots
# (every row through the bisection) and a scratch of 64 or 512 classes (the sweeps
# moving from the row to it at one point or another)
@pytest.mark.parametrize("truncation, backend, sizes", [
    *((t, "torch", None) for t in _TRUNCATIONS),
    *((t, "triton", dict(slots=8, cap=64 if i % 2 else 512)) for i, t in enumerate(_TRUNCATIONS)),
    *((t, "triton", {}) for t in _TRUNCATIONS[0:6:2] + _TRUNCATIONS[5:6])])
def test_threshold_rows_match_the_sorted_rows(truncation, backend, sizes):
    # top_p / min_p without a top-k without a sort of the row, against the sort of the
    # whole row: the Triton rows' sweeps (linear_logprobs/truncation_kernels.py:
    # bisection on the mass from a guess, the scratch, the bracket's sort, the ties) and
    # the PyTorch rows' search (truncation_rows.torch_thresholds: the 256 largest classes
    # of a peaked row, value buckets of a flat one)
    from torch_fce.ops.linear_logprobs import truncation as rows
    from torch_fce.ops.linear_logprobs.truncation_kernels import TRITON_TRUNCATION_ROWS
    from torch_fce.ops.linear_logprobs.truncation_kernels import triton_threshold_stats

    z, y, inv_t = _threshold_rows_problem()
    opts = room.LogProbOptions(entropy=True, **truncation)
    searched = TRITON_TRUNCATION_ROWS._replace(thresholds=functools.partial(
        triton_threshold_stats, **sizes)) if backend == "triton" else TORCH_TRUNCATION_ROWS
    want = rows.kept_stats(_sorted_rows(), z, y, inv_t, opts, torch.float32)
    got = rows.kept_stats(searched, z, y, inv_t, opts, torch.float32)
    _assert_outputs_match(got, want)
    stats, ref = got[4], want[4]
    cols = [0, 1, 2, 5, 6] if "top_p" not in truncation else list(range(7))
    ok = torch.isfinite(ref[:, cols])
    assert torch.equal(ok, torch.isfinite(stats[:, cols]))
    assert ((stats[:, cols] - ref[:, cols]).abs()[ok] <= 1e-5 * (1 + ref[:, cols].abs()[ok])).all()
    if "top_p" not in truncation and backend == "triton":  # min_p alone: K = {z >= thr},
        # (thr, V) for (v, c)
        thr = ref[:, 0] + math.log(truncation["min_p"])
        assert torch.equal(stats[:, 3], thr) and (stats[:, 4] == 3000).all()
    if sizes == {}:  # (a NaN row's handling does not depend on the sizes)
        return
    nan_row = z.clone()
    nan_row[2, 17] = float("nan")
    got = rows.kept_stats(searched, nan_row, y, inv_t, opts, torch.float32)
    assert got[1][2].isnan() and got[2][2].isnan()
    assert torch.equal(got[1][torch.arange(13) != 2].cpu(),
                       rows.kept_stats(searched, z, y, inv_t, opts,
                                       torch.float32)[1][torch.arange(13) != 2].cpu())


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_p=0.5, min_p=0.02),
                                        dict(top_p=0.999), dict(top_p=0.01), dict(min_p=0.1),
                                        dict(top_k=300), dict(top_k=1000, top_p=0.7),
                                        dict(top_k=2999, min_p=0.05, top_p=0.9)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_value_search_matches_the_sorted_rows(truncation, backend):
    # a vocabulary shard's search of values (truncation.sharded_kept_stats: the
    # quartered bracket of images, ties counted out by class) on the whole row as one
    # rank against the sort of the whole row, on either rows' tally (the PyTorch rows'
    # search of the sorted row, the Triton rows' sweeps); the multi-rank merge: the gloo
    # tests
    from torch_fce.ops.loop.chunked import VocabShard
    from torch_fce.ops.linear_logprobs import truncation as rows
    from torch_fce.ops.linear_logprobs.truncation_kernels import TRITON_TRUNCATION_ROWS

    search = TRITON_TRUNCATION_ROWS if backend == "triton" else TORCH_TRUNCATION_ROWS

    # (the Triton rows' kernels on the suite's device: compiled on CUDA, interpreted on
    # the CPU; the PyTorch rows' search on the CPU)
    z, y, inv_t = (t if backend == "triton" else t.cpu() for t in _threshold_rows_problem())
    opts = room.LogProbOptions(entropy=True, **truncation)
    one_rank = VocabShard(vocab_size=z.shape[1])
    want = rows.kept_stats(_sorted_rows(), z, y, inv_t, opts, torch.float32)
    got = rows.sharded_kept_stats(search, z.clone(), y, inv_t, opts, torch.float32,
                                  one_rank)
    _assert_outputs_match(got, want)
    # (v, c) the same class where the sort's rows end K (min_p alone: the smallest kept
    # value's last class here, V - 1 or below there: the same K)
    cols = [0, 1, 2, 3, 5, 6] + ([4] if "top_p" in truncation or "top_k" in truncation
                                 else [])
    stats, ref = got[4][:, cols], want[4][:, cols]
    assert torch.equal(stats.isfinite(), ref.isfinite())
    ok = ref.isfinite()
    assert ((stats - ref).abs()[ok] <= 1e-5 * (1 + ref.abs()[ok])).all()
    nan_row = z.clone()
    nan_row[2, 17] = float("nan")
    got = rows.sharded_kept_stats(search, nan_row, y, inv_t, opts, torch.float32, one_rank)
    assert got[1][2].isnan() and got[2][2].isnan()


def test_triton_processed_first_maxima_match_the_torch_rows(monkeypatch):
    # a shard's z and its first maxima from the Triton blocks' (several blocks a row)
    # against the PyTorch rows': a maximum tied across blocks (the first class), rows of
    # -inf, of NaN and holding one NaN, a softcap
    from torch_fce.ops.linear_logprobs import truncation_kernels as kernels
    from torch_fce.ops.linear_logprobs.truncation_rows import torch_processed

    monkeypatch.setattr(kernels, "_BLOCK", 128)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=g) * 3
    logits[0, [300, 700, 999]] = 20.0  # ties in three blocks
    logits[1] = -math.inf
    logits[2] = math.nan
    logits[3, 512] = math.nan
    logits[4, :] = 1.5
    inv_t = torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 1.3])
    for softcap in (None, 5.0):
        opts = room.LogProbOptions(entropy=True, top_p=0.9, softcap=softcap)
        got = kernels.triton_processed(logits.to(DEVICE), opts, inv_t.to(DEVICE),
                                       torch.float32)
        want = torch_processed(logits, opts, inv_t, torch.float32)
        assert torch.allclose(got[0].cpu(), want[0], rtol=1e-6, atol=0, equal_nan=True)
        for a, b in zip(got[1:], want[1:]):  # first max, its class, max with NaN
            assert torch.allclose(a.cpu(), b.to(a.dtype), rtol=1e-6, atol=0, equal_nan=True)
        assert got[2].tolist()[:5] == [300, 0, 0, want[2][3].item(), 0]


def test_triton_tally_spans_match_the_sorted_count(monkeypatch):
    # the Triton tally's spans (a row over several programs, the last one partial; their
    # sums added in a fixed order) against the PyTorch rows' sorted search: the counts
    # equal, the sums to rounding, a row's bits the same alone as in the batch
    from torch_fce.ops.linear_logprobs import truncation_kernels as kernels
    from torch_fce.ops.linear_logprobs.truncation_rows import torch_tally

    monkeypatch.setattr(kernels, "_TALLY_BLOCK", 256)
    monkeypatch.setattr(kernels, "_TALLY_SPAN", 1024)  # 3000 classes: three spans
    z, _, inv_t = _threshold_rows_problem()
    z = (z * inv_t[:, None]).to(DEVICE).contiguous()
    z[4, 2500] = float("nan")
    top = torch.where(z.isnan(), -math.inf, z).amax(-1)
    t = torch.stack([top - 0.5, top - 3.0, torch.full_like(top, -math.inf)], 1)
    got = kernels.triton_tally(z, top, True)(t)
    want = torch_tally(z.cpu(), top.cpu(), True)(t.cpu())
    assert torch.equal(got[0].cpu(), want[0])  # counts
    for a, b in zip(got[1:], want[1:]):  # masses, their sums times z - top
        assert torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    alone = kernels.triton_tally(z[5:6].clone(), top[5:6], True)(t[5:6])
    assert all(torch.equal(a, b[5:6]) for a, b in zip(alone, got))
    passes = torch_tally(z.cpu(), top.cpu(), False)(t.cpu())  # min_p alone's: no sort
    assert torch.equal(passes[0], want[0])
    for a, b in zip(passes[1:], want[1:]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_triton_search_rounds_match_the_tallys_search(monkeypatch):
    # the Triton rows' search (one launch a round: the last round's narrowing, this
    # one's points and span sums) against _smallest_below over the Triton tally: the same
    # u for counts and masses; and from brackets spanning every float32 (signs,
    # subnormals, -0.0 and +0.0) against a brute force
    from torch_fce.ops.linear_logprobs import truncation_kernels as kernels
    from torch_fce.ops.linear_logprobs.truncation import _smallest_below

    monkeypatch.setattr(kernels, "_TALLY_BLOCK", 256)
    monkeypatch.setattr(kernels, "_TALLY_SPAN", 1024)  # 3000 classes: three spans
    calls = []

    def reduce(x):
        calls.append(x.shape)
        return x
    z, _, inv_t = _threshold_rows_problem()
    z = (z * inv_t[:, None]).to(DEVICE).contiguous()
    top = z.amax(-1)
    lo = torch.full_like(top, torch.finfo(torch.float32).min)
    above = kernels.triton_tally(z, top, True)
    g = torch.Generator().manual_seed(9)
    for mass in (False, True):
        whole = above(torch.full_like(top, -math.inf)[:, None])[int(mass)][:, 0]
        goal = whole * torch.rand(whole.shape, generator=g).to(DEVICE)
        got = kernels.triton_search(z, top, lo, goal, mass, reduce)
        want = _smallest_below(lambda t: above(t)[int(mass)], lo, top, goal)
        assert torch.equal(got, want), mass
    assert calls == [(z.shape[0], 8)] * 24  # one reduce a round, 12 rounds a search
    big, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).smallest_normal / 4
    values = torch.cat([
        torch.randn(4, 40, generator=g) * 10,
        torch.empty(4, 40).uniform_(-1, 1, generator=g) * big,
        torch.tensor([[-big, big / 2, 0.0, -0.0, tiny, -tiny, 1.0, big] * 5] * 4)])
    goal = torch.randint(1, 40, (12,), generator=g).float()
    got = kernels.triton_search(values.to(DEVICE), values.amax(-1).to(DEVICE),
                                values.amin(-1).to(DEVICE), goal.to(DEVICE), False,
                                lambda x: x).cpu()
    for row, u, k in zip(values, got, goal):
        present = sorted(set(row.tolist()))
        assert u.item() == min(x for x in present if (row > x).sum() < k)


def test_triton_search_round_is_one_launch_and_its_reduce(monkeypatch):
    # a shard's chunk holds a few hundred rows, so the search's time is its rounds' host
    # steps (docs/rl.md): the Triton rows' round is its launch, the spans' sum and the
    # reduce, no PyTorch step more (the launches stubbed, the dispatcher's calls counted)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch_fce.ops.linear_logprobs import truncation_kernels as kernels

    class Calls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))
    launches = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)
    monkeypatch.setattr(kernels, "_search_kernel", Stub())
    z = torch.randn(4, 600)
    counts = []
    for rounds in (12, 13):
        monkeypatch.setattr(kernels, "search_rounds", lambda dtype, r=rounds: r)
        Calls.n = 0
        with Calls():
            kernels.triton_search(z, z.amax(-1), z.amin(-1), torch.ones(4), True,
                                  lambda x: x.clone())
        counts.append(Calls.n)
    assert len(launches) == 25
    assert counts[1] - counts[0] == 2  # the spans' sum and the reduce's


@given(problems())
def test_value_search_matches_the_float64_reference_of_vllms_rules(p):
    # the shard path's search of values (one rank, float64: the 34-round search) on the
    # hypothesis problems (ties, top_p reached exactly, min_p with several maxima, top_k
    # 1 to V + 5, softcap, temperatures, NaN-free) against the float64 reference
    import torch.nn.functional as F

    from torch_fce.ops.loop.chunked import VocabShard
    from torch_fce.ops.linear_logprobs import truncation as rows

    logits = F.linear(p["h"], p["w"], p["b"])
    N, V = logits.shape
    T = torch.as_tensor(p["T"], dtype=torch.float64).expand(N)
    opts = room.LogProbOptions(entropy=True, softcap=p["softcap"], **p["truncation"])
    got = rows.sharded_kept_stats(TORCH_TRUNCATION_ROWS, logits.clone(), p["target"],
                                  1.0 / T, opts, torch.float64, VocabShard(vocab_size=V))
    want = logprobs_reference(p["h"], p["w"], p["target"], p["b"], temperature=p["T"],
                              softcap=p["softcap"], **p["truncation"])
    for name, a, r in zip(("logprob", "entropy", "lse"), got, want[:3]):
        assert torch.equal(a == -math.inf, r == -math.inf), name  # the same kept targets
        a, r = (torch.where(r == -math.inf, 0.0, x) for x in (a, r))
        assert (a - r).abs().max() <= 1e-10 * (1 + r.abs().max()), name


def test_value_search_narrows_the_widest_brackets():
    # the search's fixed rounds reach the boundary value from brackets spanning every
    # float32 and float64 (signs, subnormals, -0.0 and +0.0), against a brute force
    from torch_fce.ops.linear_logprobs.truncation import _smallest_below

    for dtype in (torch.float32, torch.float64):
        big, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal / 4
        g = torch.Generator().manual_seed(3)
        values = torch.cat([
            torch.randn(4, 40, generator=g, dtype=dtype) * 10,
            torch.empty(4, 40, dtype=dtype).uniform_(-1, 1, generator=g) * big,
            torch.tensor([[-big, big / 2, 0.0, -0.0, tiny, -tiny, 1.0, big] * 5] * 4,
                         dtype=dtype)])
        goal = torch.randint(1, 40, (12,), generator=g).to(dtype)

        def count_above(t):
            return (values[:, None, :] > t[:, :, None]).sum(-1).to(dtype)

        got = _smallest_below(count_above, values.amin(-1), values.amax(-1), goal)
        for row, u, k in zip(values, got, goal):
            present = sorted(set(row.tolist()))
            assert u.item() == min(x for x in present if (row > x).sum() < k), dtype


def test_policy_loss_matches_the_reference():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    w = torch.randn(23, 6, generator=g, dtype=torch.float64)
    w[5] = w[1]
    y = torch.randint(0, 23, (2, 5), generator=g)
    y[0, :3] = (h[0, :3] @ w.T).argmax(-1)  # kept
    A = torch.randn(2, generator=g, dtype=torch.float64)
    old = torch.randn(2, 5, generator=g, dtype=torch.float64) - 1.0
    for kw in (dict(top_k=6, top_p=0.9), dict(min_p=0.1), dict(top_p=0.7)):
        for old_lp in (None, old):
            leaves = {"hidden": h.clone().requires_grad_(), "weight": w.clone().requires_grad_()}
            loss, stats = torch_fce.linear_policy_loss(
                leaves["hidden"], leaves["weight"], y, A, old_logprobs=old_lp,
                entropy_coef=0.05, temperature=0.9, **kw)
            got = [loss, *torch.autograd.grad(loss, list(leaves.values()))]
            ref_leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
            r_loss, r_lp, _ = policy_reference(ref_leaves, y, A[:, None], old=old_lp,
                                               entropy_coef=0.05, temperature=0.9, **kw)
            want = [r_loss, *torch.autograd.grad(r_loss, list(ref_leaves.values()))]
            assert torch.equal(stats.logprob == -math.inf, r_lp == -math.inf)
            for a, r in zip(got, want):
                assert (a - r).norm() <= 1e-10 * (1 + r.norm()), kw


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_triton_policy_rows_match_the_pytorch_rows(softcap):
    # the policy loss's forward-formed gradient under a truncation on the Triton rows
    # (the interpreter off the GPU) against the PyTorch rows
    from torch_fce.ops import linear_policy_loss as policy
    g = torch.Generator().manual_seed(8)
    h, w = torch.randn(9, 6, generator=g).to(DEVICE), torch.randn(37, 6, generator=g).to(DEVICE)
    y = torch.randint(0, 37, (9,), generator=g).to(DEVICE)
    y[:5] = (h[:5] @ w.T).argmax(-1)
    y[8] = -100
    A, old = (torch.randn(9, generator=g).to(DEVICE) for _ in range(2))
    opts = policy.PolicyOptions(beta=0.04, kl_ratio=True, entropy_coef=0.01, softcap=softcap,
                                top_k=6, top_p=0.9)
    args = (h, w, y, A, None, old - 3.0, old - 3.1, None,
            torch.rand(9, generator=g).to(DEVICE) + 0.5, *opts, *ONE_DEVICE,
            [True, True, False])
    with chunks(4, h, w):
        got = policy.fwd(*args, backend=TRITON)
        want = policy.fwd(*args, backend=TORCH)
    for a, b in zip(got, want):
        if a.numel():
            finite = b.isfinite()
            assert torch.equal(finite, a.isfinite())
            a, b = a[finite], b[finite]
            assert b.numel() == 0 or (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
def test_a_row_of_nan_gives_nan_and_leaves_the_others(rows):
    # a NaN hidden state: its row's outputs are NaN (no index out of bounds, no crash),
    # the other rows' as without it
    from tests.helpers import BACKENDS, nan_row_inputs

    h, bad, w, y, keep = nan_row_inputs(2, seed=10)
    T = torch.ones(4, device=DEVICE)
    opts = room.LogProbOptions(entropy=True, top_k=5, top_p=0.9)
    clean, got = (room.fwd(x, w, y, None, T, *opts, *ONE_DEVICE, backend=BACKENDS[rows])
                  for x in (h, bad))
    assert got[0][2].isnan() and got[1][2].isnan()
    for a, b in zip(got[:3], clean[:3]):
        assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("top_k", [300, 305])
def test_a_top_k_of_every_class_alone_is_the_untruncated_op(rows, top_k):
    # V past the top-k rows' candidates: the threshold rows find K with neither top_p
    # nor min_p (they once raised a TypeError there), and K is every class
    from tests.helpers import BACKENDS

    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, generator=g).to(DEVICE)
    w = (torch.randn(300, 8, generator=g) * 2).to(DEVICE)
    y = torch.randint(0, 300, (6,), generator=g).to(DEVICE)
    T = torch.full((6,), 0.7, device=DEVICE)
    untruncated, got = (room.fwd(h, w, y, None, T, *opts, *ONE_DEVICE,
                                 backend=BACKENDS[rows])
                        for opts in (room.LogProbOptions(entropy=True),
                                     room.LogProbOptions(entropy=True, top_k=top_k)))
    for a, b in zip(got[:3], untruncated[:3]):
        assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())
    assert torch.equal(got[3], untruncated[3])


def test_gradcheck_float64_on_kept_targets():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = (h @ w.T).argmax(-1).detach()
    for kw in (dict(top_k=4, top_p=0.9), dict(min_p=0.05, softcap=4.0)):
        torch.autograd.gradcheck(lambda h, w: torch_fce.linear_logprobs(
            h, w, y, temperature=0.8, entropy=True, **kw)[:2], (h, w))


def test_compiled_fullgraph_dynamic_equals_eager():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(7, 8, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(31, 8, generator=g).to(DEVICE).requires_grad_()
    y = torch.randint(0, 31, (7,), generator=g).to(DEVICE)

    def fn(h, w):
        out = torch_fce.linear_logprobs(h, w, y, top_k=5, top_p=0.9, entropy=True)
        return out.logprob, out.entropy

    eager = fn(h, w)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)(h, w)
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)
    ge = _grads(eager, (h, w))
    gc = _grads(compiled, (h, w))
    for a, c in zip(ge, gc):
        assert torch.equal(a, c)


@pytest.mark.parametrize("option,value,error", [
    ("top_k", 0, "top_k must be None"), ("top_k", 2.5, "top_k must be an int"),
    ("top_p", 0.0, "top_p must be None or a float in \\(0, 1\\]"),
    ("top_p", 1.5, "top_p must be None"), ("min_p", -0.1, "min_p must be None"),
    ("min_p", 2.0, "min_p must be None or a float in \\[0, 1\\]")])
@pytest.mark.parametrize("op", ["logprobs", "policy"])
def test_bad_values_are_named(option, value, error, op):
    h, w, y = torch.randn(3, 4), torch.randn(11, 4), torch.tensor([1, 2, 3])
    with pytest.raises((ValueError, TypeError), match=error):
        if op == "logprobs":
            torch_fce.linear_logprobs(h, w, y, **{option: value})
        else:
            torch_fce.linear_policy_loss(h, w, y, torch.ones(3), **{option: value})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_truncated_backward_on_cuda_tiles_only_where_tiles_are_the_forward_bits(dtype):
    # A truncation's threshold test needs the forward's logits to the bit. On CUDA
    # cuBLAS rounds a column tile of an odd-width product apart from the whole (an H100,
    # 34979 classes: 85% of float32 logits, 47% of bf16 ones; the hidden gradient 1.4e-2
    # to 6.7e-2 off) and a tile of a whole-128-tile width as the whole (128256 and
    # 151936: none; docs/data/raw/probe_truncated_bwd_logits_bits_h100_53a1df0.txt), so
    # there a truncated bf16 backward tiles only such widths, else cuts the forward's
    # token chunks; untruncated bf16 tiles any width (as exact against float64: raw
    # probe_odd_width_untruncated_h100_035200c.txt); float32 inputs tile both ways,
    # truncated neither; off CUDA fixed GEMM units make tiles the forward's bits.
    from torch_fce.ops.loop.chunked import vocab_tiles

    class Tensor:  # the shapes, dtype and device _cuts_vocab reads
        def __init__(self, shape, device):
            self.shape, self.dtype = shape, dtype
            self.device = torch.device(device)

    h = {d: Tensor((8192, 16), d) for d in ("cuda", "cpu")}
    for V in (34979, 274 * 128):
        w, whole = Tensor((V, 16), "cpu"), V % 128 == 0
        for truncation in (dict(), dict(top_k=50, top_p=0.95), dict(top_p=0.9),
                           dict(min_p=0.05)):
            opts = room.LogProbOptions(**truncation)
            assert room._cuts_vocab(h["cpu"], w, opts) == (False, True)
            if dtype == torch.bfloat16:
                want = (False, whole or not truncation)
            else:
                want = (False, False) if truncation else (True, True)
            assert room._cuts_vocab(h["cuda"], w, opts) == want, (V, truncation)
        # a whole-128-tile width's tiles are whole GEMM tiles, however small the chunk
        for chunk_rows in (1, 7, 100, 4096):
            cols = vocab_tiles(8192, V, chunk_rows, cuda=True)[1]
            assert not whole or cols % 128 == 0, (chunk_rows, cols)

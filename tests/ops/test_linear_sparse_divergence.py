"""linear_sparse_divergence against a float64 composition of TRL 1.16's server
distillation (tests/references.py): beta 0, between and 1, tail on and off, supports
with duplicates, invalid and all-invalid entries, teacher mass near 0 and near 1, token
weights, temperatures, softcap and logit scale, bias, odd V, several chunks; confident
rows at large magnitude in float32; gradcheck; compile; opcheck; float16 with a loss
scale; bad input named; inputs unchanged."""

import collections
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import torch_fce
from torch_fce.ops import linear_sparse_divergence as room
from torch_fce.ops.loop.chunked import ONE_DEVICE
from torch_fce.testing import rel_err

from tests import helpers
from tests.helpers import DEVICE, TRITON, chunks, confident_inputs
from tests.references import sparse_divergence_reference as reference


@st.composite
def problems(draw):
    N, D, K = draw(st.integers(1, 9)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    V = draw(st.sampled_from([2, 7, 37, 61]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = torch.randn(N, D, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 4.0]))
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    support = torch.randint(0, V, (N, K), generator=g)
    if draw(st.booleans()):  # duplicates
        support[:, -1] = support[:, 0]
    # teacher log-probs: a top-k's, with mass on the support near 0, moderate or near 1
    mass = draw(st.sampled_from([1e-6, 0.5, 1.0 - 1e-6]))
    lp = torch.randn(N, K, generator=g, dtype=torch.float64).log_softmax(-1) + math.log(mass)
    invalid = torch.rand(N, K, generator=g) < draw(st.sampled_from([0.0, 0.3]))
    support = torch.where(invalid & (torch.rand(N, K, generator=g) < 0.5), -100, support)
    lp = torch.where(invalid & (support != -100), float("-inf"), lp)
    if draw(st.booleans()):  # a token without any valid entry
        support[0] = -100
    weights = torch.rand(N, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    T = draw(st.sampled_from([1.0, 0.7, "tensor"]))
    if T == "tensor":
        T = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    options = dict(beta=draw(st.sampled_from([0.0, 0.4, 1.0])), tail=draw(st.booleans()),
                   softcap=draw(st.sampled_from([None, 3.0])),
                   logit_scale=draw(st.sampled_from([1.0, 0.5])))
    return dict(h=h, w=w, b=b, support=support, lp=lp, weights=weights, T=T,
                options=options, rows=draw(st.sampled_from([None, 2])))


def _dev(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def _run(fn, leaves, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    loss, *stats = fn(*leaves, **kw)
    return [loss.detach(), *[s.detach() for s in stats]] + list(
        torch.autograd.grad(loss, leaves))


@given(problems())
def test_matches_the_float64_composition_of_trls(p):
    h, w, b, support, lp, weights, T = (_dev(p[k]) for k in
                                        ("h", "w", "b", "support", "lp", "weights", "T"))
    leaves = [h, w] + ([b] if b is not None else [])

    def ours(h, w, b=None):
        loss, stats = torch_fce.linear_sparse_divergence(
            h, w, support, lp, b, temperature=T, token_weights=weights, **p["options"])
        return loss, stats.divergence, stats.student_mass, stats.entropy

    def theirs(h, w, b=None):
        return reference(h, w, support, lp, b, temperature=T, token_weights=weights,
                         **p["options"])

    want = _run(theirs, leaves)
    if p["rows"]:
        with chunks(p["rows"], h, w):
            got = _run(ours, leaves)
    else:
        got = _run(ours, leaves)
    for name, a, r in zip(("loss", "divergence", "mass", "entropy", "hidden", "weight",
                           "bias"), got, want):
        # float64 both: relative 1e-9, or rounding noise where the value is 0 (a support
        # of one class renormalised leaves the student nothing to move)
        assert (a - r).norm() <= 1e-9 * r.norm() + 1e-13, name


@given(problems(), st.sampled_from([1, 3, 64]), st.sampled_from([torch.float32, None]))
def test_triton_rows_match_the_float64_composition(p, rows, logits_dtype):
    # float32 inputs on the Triton kernels (the interpreter off the GPU); None: dz written
    # over the logits, the support classes' values after it
    h, w, b = (None if p[k] is None else p[k].float().to(DEVICE) for k in ("h", "w", "b"))
    support, lp = p["support"].to(DEVICE), p["lp"].float().to(DEVICE)
    N = h.shape[0]
    T = torch.as_tensor(p["T"], dtype=torch.float32).expand(N).contiguous().to(DEVICE)
    tw = None if p["weights"] is None else p["weights"].float().to(DEVICE)
    rec = room.SparseDivOptions(**p["options"], logits_dtype=logits_dtype)
    with chunks(rows, h, w):
        loss, gh, gw, gb, *stats = room.fwd(
            h, w, support, lp, b, tw, T, *rec, *ONE_DEVICE, [True, True, b is not None],
            backend=TRITON)
    leaves = [t.double().requires_grad_() for t in (h, w, b) if t is not None]
    want = reference(*leaves[:2], support, lp.double(), *leaves[2:], temperature=T.double(),
                     token_weights=None if tw is None else tw.double(), **p["options"])
    grads = torch.autograd.grad(want[0], leaves)
    scale = float((h.norm() + 1) * (w.norm() + 1))  # cancelling terms' float32 rounding
    for name, a, r in zip(("loss", "divergence", "mass", "entropy", "hidden", "weight",
                           "bias"), (loss, *stats, gh, gw, gb), (*want, *grads)):
        assert (a.double() - r.detach()).norm() <= 2e-5 * (r.norm() + scale * 1e-2), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_rows_write_a_16_bit_gradient_over_float32_logits(dtype):
    # 16-bit inputs, float32 logits: the kernel writes dz over the first half of each
    # logits row (triton/ce.dz_over) across several 4096-class blocks and chunks; the
    # PyTorch rows, dz in a buffer of its own, give the same gradients
    from tests.helpers import TORCH, dz_over_inputs

    h, w, support, g = dz_over_inputs(dtype, 6)
    lp = (torch.randn(support.shape, generator=g).log_softmax(-1) - 0.1).to(DEVICE)
    T = torch.full((h.shape[0],), 0.8, device=DEVICE)
    rec = room.SparseDivOptions(beta=0.5, tail=True, logits_dtype=torch.float32)
    out = []
    for backend in (TRITON, TORCH):
        with chunks(2, h, w):
            out.append(room.fwd(h, w, support, lp, None, None, T, *rec, *ONE_DEVICE,
                                [True, True, False], backend=backend))
    (loss, gh, gw, _, *stats), (loss0, gh0, gw0, _, *stats0) = out
    assert gh.dtype == dtype and gw.abs().max() > 0
    for name, a, r in zip(("loss", "divergence", "mass", "entropy"), (loss, *stats),
                          (loss0, *stats0)):
        assert rel_err(a, r) <= 1e-5, name
    for name, a, r in (("hidden", gh, gh0), ("weight", gw, gw0)):
        assert rel_err(a.double(), r.double()) <= 2 ** -7, name


@pytest.mark.parametrize("tail, beta", [(False, 0.0), (True, 0.5), (True, 1.0)])
def test_triton_rows_sum_a_class_over_blocks_of_a_wide_support(tail, beta):
    # K = 40: the row kernel sums g over a class's entries 16 entries at a time, and here
    # every class recurs in each block (entries j, j + 13, j + 26, j + 39 the same class)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 5, generator=g).to(DEVICE)
    w = torch.randn(53, 5, generator=g).to(DEVICE)
    support = torch.randint(0, 53, (6, 13), generator=g).repeat(1, 4)[:, :40].to(DEVICE)
    lp = (torch.randn(6, 40, generator=g).log_softmax(-1) - 0.2).to(DEVICE)
    lp[:, 5] = float("-inf")  # an invalid entry among them
    T = torch.full((6,), 0.8, device=DEVICE)
    rec = room.SparseDivOptions(beta=beta, tail=tail, softcap=4.0)
    loss, gh, gw, _, *stats = room.fwd(h, w, support, lp, None, None, T, *rec,
                                       *ONE_DEVICE, [True, True, False], backend=TRITON)
    leaves = [h.double().requires_grad_(), w.double().requires_grad_()]
    want = reference(*leaves, support, lp.double(), temperature=0.8, tail=tail, beta=beta,
                     softcap=4.0)
    grads = torch.autograd.grad(want[0], leaves)
    for name, a, r in zip(("loss", "divergence", "mass", "entropy", "hidden", "weight"),
                          (loss, *stats, gh, gw), (*want, *grads)):
        assert (a.double() - r.detach()).norm() <= 1e-5 * (r.norm() + 1e-3), name


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("tail, beta", [(False, 0.0), (True, 0.5), (False, 1.0)])
def test_an_entry_outside_the_vocabulary_makes_its_tokens_loss_nan(rows, tail, beta):
    # without the value checks (CUDA's default): that token's loss, divergence and
    # gradient NaN, as docs/api.md says, nothing read out of bounds; the others as
    # without it
    g = torch.Generator().manual_seed(4)
    h = torch.randn(4, 6, generator=g).to(DEVICE)
    w = torch.randn(17, 6, generator=g).to(DEVICE)
    support = torch.randint(0, 17, (4, 3), generator=g).to(DEVICE)
    lp = (torch.randn(4, 3, generator=g).log_softmax(-1) - 0.2).to(DEVICE)
    rec = room.SparseDivOptions(beta=beta, tail=tail)
    backend = helpers.BACKENDS[rows]._replace(check_values=False)

    def run(support):
        return room.fwd(h, w, support, lp, None, torch.ones(4, device=DEVICE) / 4,
                        torch.ones(4, device=DEVICE), *rec, *ONE_DEVICE,
                        [True, True, False], backend=backend)

    clean = run(support)
    bad = support.clone()
    bad[1, 2] = 17
    got = run(bad)
    assert got[0].isnan() and got[4][1].isnan() and got[1][1].isnan().all()
    keep = torch.tensor([0, 2, 3], device=DEVICE)
    assert torch.equal(got[4][keep], clean[4][keep])
    assert torch.equal(got[1][keep], clean[1][keep])


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5])
def test_impossible_teacher_log_probs_make_their_tokens_divergence_nan(rows, tail, value):
    # without the value checks (CUDA's default) a teacher log-prob that is NaN, +inf or
    # above 0 (at an entry not ignored) gives its token's divergence, the loss and its
    # hidden gradient NaN, never a plausible number; the other tokens as without it. Its
    # token counts (the lone entry of token 2 too), so the others' weights stay 1 / 4.
    g = torch.Generator().manual_seed(5)
    h = torch.randn(4, 6, generator=g).to(DEVICE)
    w = torch.randn(17, 6, generator=g).to(DEVICE)
    support = torch.randint(0, 17, (4, 3), generator=g).to(DEVICE)
    support[2, 1:] = -100
    lp = (torch.randn(4, 3, generator=g).log_softmax(-1) - 0.2).to(DEVICE)
    rec = room.SparseDivOptions(tail=tail)
    backend = helpers.BACKENDS[rows]._replace(check_values=False)

    def run(lp, support=support):
        return room.fwd(h, w, support, lp, None, None, torch.ones(4, device=DEVICE), *rec,
                        *ONE_DEVICE, [True, True, False], backend=backend)

    clean = run(lp)
    for token, entry in [(1, 2), (2, 0)]:
        bad = lp.clone()
        bad[token, entry] = value
        got = run(bad)
        assert got[0].isnan() and got[4][token].isnan() and got[1][token].isnan().all()
        keep = torch.tensor([t for t in range(4) if t != token], device=DEVICE)
        assert torch.equal(got[4][keep], clean[4][keep])
        assert torch.equal(got[1][keep], clean[1][keep])
    ignored, bad = support.clone(), lp.clone()
    ignored[1, 2], bad[1, 2] = -100, value  # at an ignored entry: not read
    assert not run(bad, ignored)[0].isnan()


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("softcap, tail", [(None, True), (3.0, True), (3.0, False)])
def test_a_token_not_counted_with_non_finite_logits_gives_zero_gradient(rows, softcap, tail):
    # its dz is exactly 0 from the sparse rows themselves (no pass of the callers'; no
    # entry of a SparseGrad without the tail): the other tokens' loss and every gradient
    # stay finite and equal to the run without it
    g = torch.Generator().manual_seed(6)
    h = torch.randn(5, 8, generator=g).to(DEVICE)
    w = torch.randn(19, 8, generator=g).to(DEVICE)
    support = torch.randint(0, 19, (5, 3), generator=g).to(DEVICE)
    lp = torch.randn(5, 3, generator=g).log_softmax(-1).to(DEVICE)
    support[2] = -100
    rec = room.SparseDivOptions(beta=0.5, tail=tail, softcap=softcap)
    T = torch.ones(5, device=DEVICE)

    def run(h):
        return room.fwd(h, w, support, lp, None, None, T, *rec, *ONE_DEVICE,
                        [True, True, False], backend=helpers.BACKENDS[rows])

    clean = run(h)
    bad = h.clone()
    bad[2] = 3e38  # finite, its logits +-inf (NaN after the max is taken off)
    got = run(bad)
    assert torch.equal(got[1][2], torch.zeros(8, device=DEVICE))
    for a, b in zip(got[:3], clean[:3]):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-6, atol=1e-7)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run under it, by name (views, and the interpreter's own
    copies between tensors and its arrays, left out: on CUDA none launches a kernel)."""
    SKIP = {"set_", "copy_", "empty", "new_empty", "view", "_unsafe_view", "slice",
            "select", "t", "transpose", "expand", "as_strided", "detach", "unsqueeze",
            "alias", "_reshape_alias", "lift_fresh", "unbind", "split"}

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.SKIP:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tail", [True, False])
def test_triton_rows_run_no_more_per_chunk_pytorch_ops_than_the_cross_entropy(tail):
    # per-chunk PyTorch work around the row kernel left an H200 waiting on the host
    # (linear_sparse_divergence/kernels.py): what a chunk adds beyond the cross entropy's own
    # (its GEMMs and the loop's) must be nothing; per-token work is formed once a call
    from torch_fce.ops import linear_ce

    g = torch.Generator().manual_seed(3)
    N, D, V, K = 16, 8, 64, 4
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    support = torch.randint(0, V, (N, K), generator=g)
    lp = torch.randn(N, K, generator=g).log_softmax(-1) - 0.1
    h, w, support, lp, T = (t.to(DEVICE) for t in (h, w, support, lp, torch.ones(N)))
    rec = room.SparseDivOptions(tail=tail, logits_dtype=torch.float32)
    calls = {
        "sparse": lambda: room.fwd(h, w, support, lp, None, None, T, *rec,
                                   *ONE_DEVICE, [True, True, False], backend=TRITON),
        "ce": lambda: linear_ce.fwd(h, w, support[:, 0], None, None, *linear_ce.CEOptions(),
                                    *ONE_DEVICE, [True, True, False], False, backend=TRITON)}
    per_chunk = {}
    for name, call in calls.items():
        counts = []
        for rows in (N, N // 4):
            with chunks(rows, h, w), _CountOps() as mode:
                call()
            counts.append(mode.ops)
        per_chunk[name] = counts[1] - counts[0]  # three chunks more
    assert per_chunk["sparse"] - per_chunk["ce"] == collections.Counter(), per_chunk


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
def test_a_support_class_of_minus_infinite_logit_has_no_mass_and_no_entropy(rows):
    # a student logit of -inf at a valid support class (a masked class the teacher names),
    # tail on, beta 0: its q log q is 0 (the Triton rows' entropy once formed 0 * -inf =
    # NaN); the mass and the gradients as the float64 composition's (the loss is
    # nan_to_num's largest float there, float32's or float64's), the entropy as
    # torch.special.entr's (the composition's q log q is NaN there too)
    g = torch.Generator().manual_seed(5)
    N, D, V, K = 6, 8, 41, 5
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    b = torch.randn(V, generator=g)
    support = torch.randint(0, V, (N, K), generator=g)
    b[support[0, 2]] = -math.inf
    lp = torch.randn(N, K, generator=g).log_softmax(-1) - 0.2
    rec = room.SparseDivOptions(beta=0.0, tail=True, logits_dtype=torch.float32)
    with chunks(2, h, w):
        _, gh, gw, _, _, mass, ent = room.fwd(
            *(t.to(DEVICE) for t in (h, w, support, lp, b)), None,
            torch.ones(N, device=DEVICE), *rec, *ONE_DEVICE, [True, True, False],
            backend=helpers.BACKENDS[rows])
    leaves = [t.double().requires_grad_() for t in (h, w)]
    want = reference(*leaves, support, lp.double(), b.double(), tail=True)
    grads = torch.autograd.grad(want[0], leaves)
    entropy = torch.special.entr(F.linear(*leaves, b.double()).softmax(-1)).sum(-1)
    for name, a, r in (("mass", mass, want[2]), ("entropy", ent, entropy),
                       ("hidden", gh, grads[0]), ("weight", gw, grads[1])):
        assert a.isfinite().all() and rel_err(a.cpu(), r) <= 1e-5, name


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=g, dtype=torch.float64, requires_grad=True)
    support = torch.randint(0, 13, (2, 3, 4), generator=g)
    lp = torch.randn(2, 3, 4, generator=g, dtype=torch.float64).log_softmax(-1) - 0.3
    for beta, tail in ((0.0, True), (0.5, False), (1.0, True)):
        torch.autograd.gradcheck(
            lambda h, w, b: torch_fce.linear_sparse_divergence(
                h, w, support, lp, b, beta=beta, tail=tail, temperature=0.8, softcap=5.0,
                logit_scale=0.9)[0], (h, w, b))


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_tail_of_a_support_holding_nearly_all_the_mass(rows, beta, softcap):
    # float32: the student's top-8 as the support (its mass about 1 - 1e-5 or closer),
    # the teacher's 0.9 or 1 - 1e-6, a duplicate entry and a -inf logit off the support
    # (under softcap: -30 / T); 1 - the mass cancels in float32
    # (forming it so failed beta 0 without softcap and beta 1 with it): the loss and
    # gradients within float32 rounding of the float64 composition
    g = torch.Generator().manual_seed(11)
    N, D, V, K = 16, 32, 500, 8
    h = torch.randn(N, D, generator=g) * torch.tensor([3.0] * 12 + [6.0] * 4)[:, None]
    w = torch.randn(V, D, generator=g)
    b = torch.zeros(V)
    # a class masked off by its bias (-inf: without softcap the reference's entropy is
    # NaN at 0 log 0, so a large finite one there)
    b[V - 1] = -math.inf if softcap else -1e4
    top = (h.double() @ w.double().T + b.double()).topk(K, -1).indices
    top[0, -1] = top[0, 0]  # a duplicate (TRL counts it twice: that row's tail clamped)
    tmass = torch.tensor([0.9] * 12 + [1.0 - 1e-6] * 4)[:, None]
    lp = (torch.randn(N, K, generator=g, dtype=torch.float64).log_softmax(-1) + tmass.log())
    opts = dict(beta=beta, tail=True, softcap=softcap)
    h, w, b, top, lp = (x.to(DEVICE) for x in (h, w, b, top, lp.float()))
    rec = room.SparseDivOptions(**opts)
    loss, gh, gw, gb, *stats = room.fwd(
        h, w, top, lp, b, None, torch.ones(N, device=DEVICE), *rec, *ONE_DEVICE,
        [True, True, True], backend=helpers.BACKENDS[rows])
    leaves = [x.double().requires_grad_() for x in (h, w, b)]
    want = reference(*leaves[:2], top, lp.double(), leaves[2], **opts)
    for name, a, r in zip(("hidden", "weight", "bias"), (gh, gw, gb),
                          torch.autograd.grad(want[0], leaves)):
        assert rel_err(a.double(), r) <= 1e-4, name
    for name, a, r in zip(("loss", "divergence", "mass", "entropy"), (loss, *stats), want):
        assert rel_err(a.double(), r.detach()) <= 1e-5, name


def _one_ulp_low(create_fdiv):
    """The interpreter's float32 division, each quotient one ulp toward 0: what a GPU's
    division may give (Triton lowers `/` to div.full.f32, within 2 ulp, not IEEE's)."""
    import numpy as np
    from triton.runtime import interpreter

    def fdiv(self, lhs, rhs):
        out = create_fdiv(self, lhs, rhs)
        if out.data.dtype != np.float32:
            return out
        low = np.nextafter(out.data, np.float32(0)).astype(np.float32)
        return interpreter.TensorHandle(np.where(np.isfinite(out.data), low, out.data),
                                        out.dtype)
    return fdiv


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter's division")
@pytest.mark.parametrize("beta, softcap", [(0.0, None), (1.0, 30.0)])
def test_the_tail_holds_whatever_the_gpus_division_rounds(beta, softcap):
    # the rest cancels where it is small: a quotient one ulp off (1 / 1 among them) must
    # not reach it (the kernel once formed a class's excess as 1 - 1 / multiplicity:
    # 4.9e-3 off the hidden gradient)
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    with mock.patch.object(builder, "create_fdiv", _one_ulp_low(builder.create_fdiv)):
        test_the_tail_of_a_support_holding_nearly_all_the_mass("triton_rows", beta, softcap)


def test_float32_confident_rows_at_large_magnitude():
    # logits about 50 +- 20, the teacher's top-4 carrying nearly all the mass: float32
    # logits (the default) within float32's rounding of the float64 composition; and,
    # from another token's hotter top-4 (a gradient far from 0), the gradients too
    h, w, y = (x.to(DEVICE) for x in confident_inputs(48, 24, 257, offset=50.0))
    top = torch_fce.linear_topk_logprobs(h.double(), w.double(), 4)
    other = torch_fce.linear_topk_logprobs(h.double().flip(0), w.double(), 4, temperature=3.0)
    for tail in (False, True):
        loss, _ = torch_fce.linear_sparse_divergence(h, w, top.indices, top.logprobs.float(),
                                                     tail=tail)
        want = reference(h.double(), w.double(), top.indices, top.logprobs, tail=tail)[0]
        assert abs(loss.double() - want) <= 1e-5 * max(1.0, abs(want.item())), tail
        got = _run(lambda h, w: (torch_fce.linear_sparse_divergence(
            h, w, other.indices, other.logprobs.float(), tail=tail)[0],), [h, w])
        want = _run(lambda h, w: (reference(h, w, other.indices, other.logprobs,
                                            tail=tail)[0],), [h.double(), w.double()])
        for a, r in zip(got[-2:], want[-2:]):
            assert rel_err(a.double(), r) <= 1e-4, tail


def test_shift_equals_the_shifted_support_and_inputs_unchanged():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 8, generator=g).to(DEVICE)
    w = torch.randn(11, 8, generator=g).to(DEVICE)
    support = torch.randint(0, 11, (2, 5, 3), generator=g).to(DEVICE)
    lp = torch.randn(2, 5, 3, generator=g).log_softmax(-1).to(DEVICE)
    before = [x.clone() for x in (h, w, support, lp)]
    got = _run(lambda h, w: torch_fce.linear_sparse_divergence(h, w, support, lp,
                                                               shift=True)[:1], [h, w])
    shifted = torch.cat([support[:, 1:], torch.full_like(support[:, :1], -100)], 1)
    want = _run(lambda h, w: torch_fce.linear_sparse_divergence(
        h, w, shifted, torch.cat([lp[:, 1:], lp[:, :1]], 1))[:1], [h, w])
    for a, r in zip(got, want):
        assert torch.equal(a, r)
    assert all(torch.equal(a, b) for a, b in zip((h, w, support, lp), before))


def test_float16_takes_the_loss_scale_before_rounding():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(24, 16, generator=g).half().to(DEVICE)
    w = (torch.randn(53, 16, generator=g) * 0.5).half().to(DEVICE)
    support = torch.randint(0, 53, (24, 4), generator=g).to(DEVICE)
    lp = torch.randn(24, 4, generator=g).log_softmax(-1).to(DEVICE)
    weights = torch.full((24,), 1e-6, device=DEVICE)  # unit-scale dz would underflow
    scale = 2.0 ** 16
    got = _run(lambda h, w: (torch_fce.linear_sparse_divergence(
        h, w, support, lp, token_weights=weights, beta=0.5)[0] * scale,), [h, w])
    want = _run(lambda h, w: (reference(h.double(), w.double(), support, lp,
                                        token_weights=weights, beta=0.5)[0] * scale,), [h, w])
    for a, r in zip(got[1:], want[1:]):
        assert a.dtype == torch.float16 and a.abs().max() > 0
        assert rel_err(a.double(), r) <= 4 * 2.0 ** -10


@pytest.mark.parametrize("tail", [True, False])
def test_compiled_fullgraph_dynamic_equals_eager(tail):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(9, 8, generator=g).to(DEVICE)
    w = torch.randn(29, 8, generator=g).to(DEVICE)
    support = torch.randint(0, 29, (9, 3), generator=g).to(DEVICE)
    lp = torch.randn(9, 3, generator=g).log_softmax(-1).to(DEVICE)

    def fn(h, w):
        return torch_fce.linear_sparse_divergence(h, w, support, lp, beta=0.3, tail=tail)[0],

    eager = _run(fn, [h, w])
    compiled = _run(torch.compile(fn, fullgraph=True, dynamic=True), [h, w])
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)


@pytest.mark.parametrize("accumulator, tail", [("fp32", True), ("kahan", True),
                                               ("fp32", False), ("input", False)])
def test_opcheck(accumulator, tail):
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(6, 4, generator=g, requires_grad=True),
            torch.randn(13, 4, generator=g, requires_grad=True),
            torch.randint(0, 13, (6, 3), generator=g),
            torch.randn(6, 3, generator=g).log_softmax(-1))
    torch.library.opcheck(torch.ops.fce.linear_sparse_divergence.default, args,
                          dict(beta=0.5, tail=tail, accumulator=accumulator))


def _small():
    g = torch.Generator().manual_seed(6)
    return (torch.randn(3, 4, generator=g), torch.randn(7, 4, generator=g),
            torch.randint(0, 7, (3, 2), generator=g),
            torch.randn(3, 2, generator=g).log_softmax(-1))


@pytest.mark.parametrize("change, error, named", [
    (dict(beta=1.5), ValueError, "beta"),
    (dict(tail=1), TypeError, "tail"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(support=torch.zeros(3, 2)), TypeError, "support"),
    (dict(teacher_logprobs=torch.zeros(3, 3)), ValueError, "teacher_logprobs"),
    (dict(teacher_logprobs=torch.full((3, 2), math.nan)), ValueError, "teacher_logprobs"),
    (dict(teacher_logprobs=torch.full((3, 2), 0.5)), ValueError, "teacher_logprobs"),
    (dict(support=torch.zeros(3, dtype=torch.long)), ValueError, "support"),
    (dict(support=torch.zeros(2, 2, dtype=torch.long)), ValueError,
     "support must have shape .* hidden's leading shape"),
    (dict(token_weights=torch.ones(4)), ValueError,
     "token_weights must have hidden's leading shape"),
    (dict(temperature=torch.ones(2)), ValueError, "temperature .*hidden's leading shape"),
    (dict(shift=1), TypeError, "shift"),
    (dict(accumulator="fp64"), ValueError, "accumulator"),
])
def test_bad_input_is_named(change, error, named):
    h, w, support, lp = _small()
    args = dict(hidden=h, weight=w, support=support, teacher_logprobs=lp)
    args.update({k: v for k, v in change.items() if k in args})
    options = {k: v for k, v in change.items() if k not in args}
    with pytest.raises(error, match=named):
        torch_fce.linear_sparse_divergence(**args, **options)


@pytest.mark.cuda
@pytest.mark.parametrize("tail", [True, False])
def test_on_cuda_has_no_host_sync(tail):
    from tests.helpers import no_host_sync

    g = torch.Generator().manual_seed(7)
    h = torch.randn(64, 32, generator=g).bfloat16().cuda()
    w = torch.randn(509, 32, generator=g).bfloat16().cuda()
    top = torch_fce.linear_topk_logprobs(h.flip(0), w, 8)  # a teacher's top-8
    leaves = [h.requires_grad_(), w.requires_grad_()]
    with no_host_sync():
        loss, stats = torch_fce.linear_sparse_divergence(*leaves, top.indices, top.logprobs,
                                                         beta=0.5, tail=tail, temperature=0.9)
        loss.backward()
    want = reference(h.double(), w.double(), top.indices, top.logprobs, beta=0.5, tail=tail,
                     temperature=0.9)
    assert abs(loss.item() - want[0].item()) <= 1e-4 * abs(want[0].item())

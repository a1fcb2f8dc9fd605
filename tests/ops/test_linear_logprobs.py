"""linear_logprobs against a float64 reference built from the logits (log_softmax, gather,
entropy), every option, any upstream gradients; gradcheck; compile; opcheck; bad input;
the Triton row kernel under the interpreter."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.ops.loop import chunked
from torch_fce.ops import linear_logprobs
from torch_fce.ops.linear_ce import CEOptions
from torch_fce.ops.linear_logprobs import LogProbOptions
from torch_fce.ops.linear_logprobs.rows import TORCH_LOGPROB_ROWS, empty_tile_stats, finish_stats
from torch_fce.ops.linear_ce.rows import TORCH_CE_ROWS
from torch_fce.ops.linear_logprobs.kernels import TRITON_LOGPROB_ROWS
from torch_fce.ops.linear_ce.kernels import TRITON_CE_ROWS
from torch_fce.testing import make_inputs, rel_err
from tests.references import logprobs_reference as reference
from tests.helpers import (
    EPS, capture_cuda_graph, confident_grads, confident_inputs, logprob_composition,
    no_host_sync)

from tests.helpers import BACKENDS, ONE_DEVICE, TORCH, TRITON, chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype, V):
    # The op rounds the logits to hidden's dtype before the float32 row math.
    return 8 * EPS[dtype] * max(1.0, V ** 0.5 / 8)


@st.composite
def logprob_problems(draw):
    N = draw(st.sampled_from([1, 2, 7, 24]))
    D = draw(st.sampled_from([1, 4, 17]))
    V = draw(st.sampled_from([2, 31, 97, 257]))
    x = make_inputs(N, D, V, torch.float32, ignore_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
                    bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                    weight_scale=draw(st.sampled_from([1.0, 4.0])))
    x.pop("class_weight")
    per = draw(st.sampled_from(["scalar", "token", "sequence"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if N % 2 == 0 and draw(st.booleans()):  # a (B, T) batch
        x["hidden"] = x["hidden"].reshape(2, N // 2, D)
        x["target"] = x["target"].reshape(2, N // 2)
    shape = x["target"].shape
    temperature = {"scalar": draw(st.sampled_from([1.0, 0.7, 1.6])),
                   "token": torch.rand(shape, generator=g) + 0.3,
                   "sequence": torch.rand(*shape[:-1], 1, generator=g) + 0.3}[per]
    options = dict(temperature=temperature, softcap=draw(st.sampled_from([None, 3.0])),
                   entropy=draw(st.booleans()))
    upstream = draw(st.sampled_from(["both", "logprob", "entropy"]))
    return x, options, upstream


def _objective(out, upstream, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp, ent = out[0], out[1]
    total = 0.0
    if upstream in ("both", "logprob") or ent is None:
        total = total + (lp * torch.randn(lp.shape, generator=g).to(lp)).sum()
    if upstream in ("both", "entropy") and ent is not None:
        total = total + (ent * torch.randn(ent.shape, generator=g).to(ent)).sum()
    return total


@given(logprob_problems())
def test_linear_logprobs_match_reference(problem):
    x, options, upstream = problem
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")
              if x[k] is not None}
    got = torch_fce.linear_logprobs(leaves["hidden"], leaves["weight"], x["target"],
                                    leaves.get("bias"), **options)
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = reference(ref_leaves["hidden"], ref_leaves["weight"], x["target"],
                    ref_leaves.get("bias"), options["temperature"], options["softcap"])
    V = x["weight"].shape[0]
    tol = _tol(torch.float32, V)
    assert got.logprob.dtype == torch.float32 and got.argmax.dtype == torch.int64
    assert rel_err(got.logprob, ref[0]) <= tol and rel_err(got.lse, ref[2]) <= tol
    assert (got.entropy is None) != options["entropy"]
    if options["entropy"]:
        assert rel_err(got.entropy, ref[1]) <= tol
    assert torch.equal(got.argmax, ref[3])
    total = _objective(got, upstream)
    if not torch.is_tensor(total) or not total.requires_grad:
        return
    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    ref_out = (ref[0], ref[1] if options["entropy"] else None)
    ref_grads = torch.autograd.grad(_objective(ref_out, upstream), list(ref_leaves.values()),
                                    allow_unused=True)
    for name, a, b in zip(leaves, grads, ref_grads):
        b = torch.zeros_like(leaves[name], dtype=torch.float64) if b is None else b
        a = torch.zeros_like(b) if a is None else a
        assert rel_err(a, b) <= 4 * tol, name


def test_linear_logprobs_gradcheck_float64():
    x = make_inputs(7, 4, 11, torch.float64, bias=True, ignore_frac=0.3)
    T = torch.rand(7, dtype=torch.float64) + 0.5
    args = (x["hidden"].requires_grad_(), x["weight"].requires_grad_(),
            x["bias"].requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w, b: torch_fce.linear_logprobs(
        h, w, x["target"], b, temperature=T, softcap=2.0, entropy=True)[:2], args)


def test_linear_logprobs_all_ignored_and_shift():
    x = make_inputs(2 * 6, 4, 13)
    h, t = x["hidden"].reshape(2, 6, 4).requires_grad_(), x["target"].reshape(2, 6)
    out = torch_fce.linear_logprobs(h, x["weight"], torch.full_like(t, -100), entropy=True)
    assert torch.equal(out.logprob, torch.zeros(2, 6)) and torch.equal(out.entropy,
                                                                        torch.zeros(2, 6))
    (out.logprob.sum() + out.entropy.sum()).backward()
    assert torch.equal(h.grad, torch.zeros_like(h))
    shifted = torch_fce.linear_logprobs(h, x["weight"], t, shift=True, temperature=0.5)
    want = reference(h[:, :-1], x["weight"], t[:, 1:], temperature=0.5)[0]
    assert rel_err(shifted.logprob[:, :-1], want) <= _tol(torch.float32, 13)
    assert torch.equal(shifted.logprob[:, -1], torch.zeros(2))


def test_linear_logprobs_no_tokens():
    # Fewer tokens than classes: the vocabulary tiles run, on rows of none.
    h = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(50, 8, device=DEVICE, requires_grad=True)
    out = torch_fce.linear_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                    entropy=True)
    assert out.logprob.shape == out.entropy.shape == out.argmax.shape == (0,)
    (out.logprob.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))


def test_linear_logprobs_reused_retained_and_inputs_unchanged():
    x = make_inputs(8, 4, 13, bias=True)
    before = {k: v.clone() for k, v in x.items() if v is not None}
    h = x["hidden"].requires_grad_()
    out = torch_fce.linear_logprobs(h, x["weight"], x["target"], x["bias"], entropy=True)
    total = out.logprob.sum() * 2.0 + out.entropy.sum() - out.logprob.sum()
    total.backward(retain_graph=True)
    total.backward()
    ref_h = x["hidden"].detach().double().requires_grad_()
    ref = reference(ref_h, x["weight"], x["target"], x["bias"])
    (2 * (ref[0].sum() + ref[1].sum())).backward()
    assert rel_err(h.grad, ref_h.grad) <= _tol(torch.float32, 13)
    assert all(torch.equal(x[k].detach(), v) for k, v in before.items())


def test_linear_logprobs_outputs_edited_in_place_keep_the_gradient():
    # The backward uses the forward's lse and entropy statistics: from copies of its own.
    x = make_inputs(8, 4, 13, bias=True, ignore_frac=0.3)
    h = x["hidden"].requires_grad_()
    out = torch_fce.linear_logprobs(h, x["weight"], x["target"], x["bias"], temperature=0.7,
                                    entropy=True)
    mask = torch.rand(8) > 0.5
    out.lse.zero_()
    ent = out.entropy.masked_fill_(mask, 0.0)
    (out.logprob.sum() + 3.0 * ent.sum()).backward()
    ref_h = x["hidden"].detach().double().requires_grad_()
    ref = reference(ref_h, x["weight"], x["target"], x["bias"], temperature=0.7)
    (ref[0].sum() + 3.0 * ref[1].masked_fill(mask, 0.0).sum()).backward()
    assert rel_err(h.grad, ref_h.grad) <= _tol(torch.float32, 13)


def test_linear_logprobs_compiled_matches_eager():
    x = make_inputs(12, 4, 13, bias=True)
    T = torch.rand(2, 1) + 0.5

    def step(h, w, b):
        out = torch_fce.linear_logprobs(h, w, x["target"].reshape(2, 6), b, temperature=T,
                                        softcap=3.0, entropy=True)
        return out.logprob, out.entropy, out.argmax

    def grads(fn):
        leaves = [x[k].detach().clone().requires_grad_() for k in ("weight", "bias")]
        h = x["hidden"].reshape(2, 6, 4).detach().clone().requires_grad_()
        lp, ent, am = fn(h, *leaves)
        (lp.sum() + (ent * 0.5).sum()).backward()
        return lp, am, h.grad, leaves[0].grad

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for a, b in zip(grads(compiled), grads(step)):
        assert torch.equal(a, b) if not a.is_floating_point() else rel_err(a, b) <= 1e-6


def test_linear_logprobs_compiled_float_temperatures():
    # dynamic=True makes a float temperature symbolic: no error, no compile per value.
    from torch._dynamo.testing import CompileCounterWithBackend

    def fresh(h, w, t, temperature):
        return torch_fce.linear_logprobs(h, w, t, temperature=temperature).logprob

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(fresh, fullgraph=True, dynamic=True, backend=counter)
    x = make_inputs(8, 4, 13)
    for T in (0.7, 0.8, 1.3):
        got = fn(x["hidden"], x["weight"], x["target"], T)
        assert rel_err(got, fresh(x["hidden"], x["weight"], x["target"], T)) <= 1e-6
    assert counter.frame_count <= 2


def test_linear_logprobs_dynamic_tokens_no_recompile_storm():
    from torch._dynamo.testing import CompileCounterWithBackend

    def fresh(h, w, t, temperature):  # its own code object: no dynamism learnt elsewhere
        out = torch_fce.linear_logprobs(h, w, t, temperature=temperature, entropy=True)
        return out.logprob.sum() + out.entropy.sum()

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(fresh, fullgraph=True, backend=counter)
    for n in (5, 7, 9, 16, 31):  # varying tokens and a per-token temperature
        x = make_inputs(n, 8, 37)
        h = x["hidden"].requires_grad_()
        fn(h, x["weight"], x["target"], torch.rand(n) + 0.5).backward()
        assert h.grad is not None
    assert counter.frame_count == 2  # one static compile, then one dynamic graph for all N


@pytest.mark.parametrize("entropy", [False, True])
def test_linear_logprobs_opcheck(entropy):
    x = make_inputs(6, 4, 9, torch.bfloat16, bias=True)
    args = (x["hidden"].reshape(2, 3, 4).requires_grad_(), x["weight"].requires_grad_(),
            x["target"].reshape(2, 3), x["bias"], torch.rand(2, 3) + 0.5)
    torch.library.opcheck(torch.ops.fce.linear_logprobs.default, args,
                          dict(softcap=5.0, entropy=entropy))
    flat = (x["hidden"].detach(), x["weight"].detach(), x["target"], x["bias"],
            torch.rand(6) + 0.5, *LogProbOptions(softcap=5.0, entropy=entropy), *ONE_DEVICE)
    torch.library.opcheck(torch.ops.fce.linear_logprobs_fwd.default, flat)
    row_stats = torch.ops.fce.linear_logprobs_fwd(*flat)[4]
    torch.library.opcheck(torch.ops.fce.linear_logprobs_bwd.default,
                          (torch.randn(6), torch.randn(6) if entropy else None, row_stats,
                           *flat, [True, True, True]))


BAD = [
    ("temperature 0", dict(temperature=0.0), ValueError, "temperature"),
    ("temperature nan", dict(temperature=float("nan")), ValueError, "temperature"),
    ("temperature str", dict(temperature="hot"), TypeError, "temperature"),
    ("temperature tensor <= 0", dict(temperature=torch.tensor([[0.5], [-1.0]])), ValueError,
     "temperature"),
    ("temperature tensor nan", dict(temperature=torch.full((2, 3), float("nan"))),
     ValueError, "temperature"),
    ("temperature shape", dict(temperature=torch.ones(4)), ValueError, "temperature"),
    ("temperature dtype", dict(temperature=torch.ones(2, 3, dtype=torch.int64)), TypeError,
     "temperature"),
    ("temperature grad", dict(temperature=torch.ones(2, 3, requires_grad=True)), ValueError,
     "temperature"),
    ("softcap", dict(softcap=-1.0), ValueError, "softcap"),
    ("entropy", dict(entropy="yes"), TypeError, "entropy"),
    ("accumulator", dict(accumulator="bf16"), ValueError, "accumulator"),
    ("shift", dict(shift=1), TypeError, "shift"),
]


@pytest.mark.parametrize("name,options,error,argument", BAD, ids=[b[0] for b in BAD])
def test_linear_logprobs_bad_input_names_argument(name, options, error, argument):
    x = make_inputs(6, 4, 9)
    with pytest.raises(error, match=argument):
        torch_fce.linear_logprobs(x["hidden"].reshape(2, 3, 4), x["weight"],
                                  x["target"].reshape(2, 3), **options)


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_logprob_rows_match_their_pytorch_twin(softcap, entropy, dtype):
    # Triton's interpreter on CPU tensors (CI), the real kernel on a GPU.
    x = {k: v if v is None else v.to(DEVICE) for k, v in make_inputs(
        9, 5, 37, dtype, bias=True, ignore_frac=0.3, weight_scale=2.0).items()}
    # seeded, not the global generator: the inputs must not depend on the tests run before
    # (a draw after the batch-invariance tests put a float32 softcap gradient at 8.6 eps,
    # over the 8; 60 seeds' worst was 4.3 eps)
    g = torch.Generator().manual_seed(3)
    T = (torch.rand(9, generator=g) + 0.5).to(DEVICE)
    g_lp, g_h = (torch.randn(2, 9, generator=g)).to(DEVICE).unbind(0)
    args = (x["hidden"], x["weight"], x["target"], x["bias"], T,
            *LogProbOptions(softcap=softcap, entropy=entropy), *ONE_DEVICE)
    outs = []
    for backend in (TORCH, TRITON):
        with chunks(4, x["hidden"], x["weight"]):
            fwd = linear_logprobs.fwd(*args, backend=backend)
            bwd = linear_logprobs.bwd(g_lp, g_h if entropy else None, fwd[4], *args,
                                      [True, True, True], backend=backend)
        outs.append((fwd, bwd))
    (f0, b0), (f1, b1) = outs
    assert torch.equal(f0[3], f1[3])  # argmax
    stats = (f0[4], f1[4]) if entropy else (f0[4][:, :2], f1[4][:, :2])
    for a, b, tol in zip((*f0[:3], stats[0], *b0), (*f1[:3], stats[1], *b1),
                         (4, 4, 4, 4, 8, 8, 8)):
        assert a.shape == b.shape and (a.numel() == 0 or rel_err(a, b) <= tol * EPS[dtype])


@pytest.mark.parametrize("entropy", [False, True])
def test_triton_logprob_forward_on_long_rows_with_ties_and_infinities(entropy):
    # Rows of several 4096-wide blocks of the kernel's online sweep: ties across blocks
    # (columns 7 and 7 + 4096) and within one go to the first column, -inf logits add
    # nothing, a row of all -inf stays finite where its PyTorch twin does. Whole rows,
    # and tiles merged into running statistics.
    V = 9001
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 4.0
    logits[0, [7, 7 + 4096, 8000]] = 30.0  # ties in one lane and across lanes
    logits[1, [9000, 4096 + 9]] = 25.0
    logits[2, ::3] = float("-inf")
    logits[3] = float("-inf")
    logits[4, 4100] = 60.0  # a confident row whose max is in the second block
    logits = logits.to(DEVICE)
    target = torch.tensor([7, 0, 2, -100, 4100], device=DEVICE)
    inv_t = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0], device=DEVICE)
    opts = LogProbOptions()
    want = TORCH_LOGPROB_ROWS.stats(logits.clone(), target, inv_t, opts, entropy,
                                    torch.float32)
    got = TRITON_LOGPROB_ROWS.stats(logits.clone(), target, inv_t, opts, entropy,
                                    torch.float32)
    assert torch.equal(got[3], want[3]) and got[3][:2].tolist() == [7, 4096 + 9]

    def defined(out):  # the entropy and d are only formed when asked for; the all -inf
        lp, ent, lse, _, stats = out[:5]  # row's max is a finite stand-in (float32's lowest)
        return (lp, lse, stats[[0, 1, 2, 4], :2]) + ((ent, stats[:, 2]) if entropy else ())

    for a, b in zip(defined(got), defined(want)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The same rows as two tiles merged into running statistics.
    for rows in (TORCH_LOGPROB_ROWS, TRITON_LOGPROB_ROWS):
        total = empty_tile_stats(5, torch.float32, DEVICE)
        for v0, v1 in ((0, 5000), (5000, V)):
            rows.tile_stats(logits[:, v0:v1].clone(), target, inv_t, opts, entropy,
                            torch.float32, v0, total)
        merged = finish_stats(total, target, V, -100, entropy)
        assert torch.equal(merged[3], want[3])
        for a, b in zip(defined(merged), defined(want)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("rows", [TORCH_LOGPROB_ROWS, TRITON_LOGPROB_ROWS],
                         ids=["torch_rows", "triton_rows"])
def test_logprob_rows_nan_never_wins_and_huge_maxima(rows):
    # Whole rows and two merged tiles agree: a NaN logit is never the argmax (row 0's
    # most likely finite class sits in the tile before the NaN's), and rows whose max
    # passes 1e31 (row 1) or whose logits are all below -1e30 (row 2) keep finite
    # statistics: no -inf * 0 when a tile's sums are rebased onto the running max.
    logits = torch.tensor([[1.0, 10.0, 0.0, float("nan"), 5.0, 2.0],
                           [2e31, 1e31, 0.0, 0.0, 3e31, -1e31],
                           [-2e31, -3e31, -2e31, -5e31, -4e31, -2e31]], device=DEVICE)
    target = torch.tensor([1, 4, 0], device=DEVICE)
    inv_t = torch.ones(3, device=DEVICE)
    opts = LogProbOptions()
    whole = rows.stats(logits.clone(), target, inv_t, opts, True, torch.float32)
    total = empty_tile_stats(3, torch.float32, DEVICE)
    for v0, v1 in ((0, 3), (3, 6)):
        rows.tile_stats(logits[:, v0:v1].clone(), target, inv_t, opts, True, torch.float32,
                        v0, total)
    tiles = finish_stats(total, target, 6, -100, True)
    for out in (whole, tiles):
        logprob, ent, lse, argmax, stats = out[:5]
        assert argmax.tolist() == [1, 4, 0]
        assert logprob[0].isnan() and ent[0].isnan()  # the NaN still poisons its row
        assert logprob[1] == 0.0 and ent[1] == 0.0
        # row 2: three classes tie at the max, -2e31 + log 3 rounds to -2e31; the target's
        # log-prob, formed relative to the max, is still log(1/3)
        log3 = torch.tensor(3.0).log().to(DEVICE)
        assert lse[2] == -2e31 and torch.isclose(ent[2], log3)
        assert torch.isclose(logprob[2], -log3)
        assert stats[1:].isfinite().all()


def test_linear_logprobs_huge_maxima_through_the_op():
    # Both loop orders (N < V cuts the vocabulary): a max logit of 2e31 after the
    # temperature gives a 0 entropy and finite gradients.
    w = torch.tensor([[2.0], [1.0], [0.0], [0.0]], device=DEVICE, requires_grad=True)
    for N in (2, 4):
        h = torch.ones(N, 1, device=DEVICE, requires_grad=True)
        out = torch_fce.linear_logprobs(h, w, torch.zeros(N, dtype=torch.long, device=DEVICE),
                                        temperature=1e-31, entropy=True)
        assert out.entropy.tolist() == [0.0] * N and out.logprob.tolist() == [0.0] * N
        gh, gw = torch.autograd.grad((out.logprob + out.entropy).sum(), (h, w))
        assert gh.isfinite().all() and gw.isfinite().all()


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_ce_rows_nan_never_wins_and_logits_below_minus_1e30(softcap):
    logits = torch.tensor([[1.0, 10.0, float("nan"), 5.0],
                           [-2e31, -2e31, -3e31, -4e31]], device=DEVICE)
    target = torch.tensor([1, 0], device=DEVICE)
    opts = CEOptions(softcap=softcap)
    for rows in (TORCH_CE_ROWS, TRITON_CE_ROWS):
        lse, nll, _, argmax, entropy = rows.stats(logits.clone(), target, None, opts, True,
                                                  torch.float32)
        assert argmax.tolist() == [1, 0] and lse[0].isnan() and entropy[0].isnan()
        if softcap is None:  # two classes tie at -2e31, the others have p = 0
            assert lse[1] == -2e31 and nll[1].item() == pytest.approx(math.log(2), rel=1e-6)
            assert entropy[1].item() == pytest.approx(math.log(2), rel=1e-6)
        else:  # all four softcapped to -4: uniform
            assert entropy[1].item() == pytest.approx(math.log(4), rel=1e-6)


@pytest.mark.parametrize("rows", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("N, by_vocab", [(12, True), (45, False)])
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_logprobs_by_tokens_and_by_vocabulary(rows, N, by_vocab, weight_dtype):
    # Fewer tokens than classes: forward and backward cut their workspace along the
    # vocabulary (tiles of 37 // 3 classes here, the last one short); more: along the
    # tokens. Both equal float64, with a target in every tile, the most likely class
    # tied across two tiles (the first wins), ignored rows, bias, softcap, per-token
    # temperatures, an entropy gradient and float32 master weights.
    V = 37
    assert chunked.by_vocab(N, V) == by_vocab
    x = {k: v if v is None else v.to(DEVICE) for k, v in make_inputs(
        N, 5, V, torch.float16, bias=True, ignore_frac=0.25, weight_scale=2.0).items()}
    w, b = x["weight"].to(weight_dtype), x["bias"].to(weight_dtype)
    w[30], b[3], b[30] = w[3], 4.0, 4.0  # 3 and 30 tie, the most likely class of many rows
    target = x["target"]
    T = torch.rand(N, device=DEVICE) + 0.5
    g_lp, g_h = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    args = (x["hidden"], w, target, b, T, *LogProbOptions(softcap=4.0, entropy=True), *ONE_DEVICE)
    # three tiles or chunks (by vocabulary: 37 // 3 classes each)
    with chunks(N // 3, x["hidden"], w):
        logprob, ent, lse, argmax, row_stats = linear_logprobs.fwd(*args,
                                                                   backend=BACKENDS[rows])
        gh, gw, gb = linear_logprobs.bwd(g_lp, g_h, row_stats, *args, [True, True, True],
                                         backend=BACKENDS[rows])
    assert (gh.dtype, gw.dtype, gb.dtype) == (torch.float16, weight_dtype, weight_dtype)
    leaves = [t.detach().double().requires_grad_() for t in (x["hidden"], w, b)]
    ref = reference(*leaves[:2], target, leaves[2], T.double(), 4.0)
    assert (ref[3] == 3).sum() > N // 4 and torch.equal(argmax, ref[3])
    for got, want in zip((logprob, ent, lse), ref):
        assert rel_err(got, want) <= 4 * EPS[torch.float16]
    want = torch.autograd.grad((ref[0] * g_lp.double() + ref[1] * g_h.double()).sum(),
                               leaves)
    for got, ref_grad in zip((gh, gw, gb), want):
        assert rel_err(got, ref_grad) <= 8 * EPS[torch.float16]


@pytest.mark.parametrize("backend", ["op", "triton_rows", "torch_rows"])
def test_linear_logprobs_confident_rows_at_large_magnitude(backend):
    # Logits around 20 +- 20 (lse about 70), most rows p(target) > 0.98: the gradients are
    # as close to float64 as torch's float32 log_softmax (docs/numerics.md: within twice
    # its error), overall and for each token's hidden gradient.
    x = tuple(t.to(DEVICE) for t in confident_inputs(48, 24, 257))
    target = x[2]
    ref = confident_grads(logprob_composition(target), torch.float64, x)
    torch_f32 = confident_grads(logprob_composition(target), torch.float32, x)
    if backend == "op":
        def fce(h, w):
            out = torch_fce.linear_logprobs(h, w, target, entropy=True)
            return out.logprob, out.entropy
    else:  # one row function on the shared loop, Triton's under the interpreter on CPU
        rows = BACKENDS[backend]
        opts = (*LogProbOptions(entropy=True), *ONE_DEVICE)

        class fce_rows(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h, w):
                with chunks(16, h, w):
                    out = linear_logprobs.fwd(h, w, target, None, None, *opts, backend=rows)
                ctx.save_for_backward(h, w, out[4])
                return out[0], out[1]

            @staticmethod
            def backward(ctx, g_lp, g_h):
                h, w, row_stats = ctx.saved_tensors
                with chunks(16, h, w):
                    gh, gw, _ = linear_logprobs.bwd(g_lp, g_h, row_stats, h, w, target, None,
                                                    None, *opts, [True, True, False],
                                                    backend=rows)
                return gh, gw

        fce = fce_rows.apply
    got = confident_grads(fce, torch.float32, x)
    for a, b, r in zip(got, torch_f32, ref):
        assert rel_err(a, r) <= 2 * rel_err(b, r) + 1e-7
    per_token = [rel_err(a, r) for a, r in zip(got[0], ref[0])]
    per_token_torch = [rel_err(b, r) for b, r in zip(torch_f32[0], ref[0])]
    assert max(per_token) <= 2 * max(per_token_torch) + 1e-7


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_ce_return_stats_from_the_same_pass(reduction):
    x = make_inputs(12, 4, 13, bias=True, ignore_frac=0.3)
    h = x["hidden"].detach().clone().requires_grad_()
    loss, stats = torch_fce.linear_cross_entropy(h, x["weight"], x["target"], x["bias"],
                                                 softcap=5.0, z_loss=1e-2, reduction=reduction,
                                                 return_stats=True)
    plain = torch_fce.linear_cross_entropy(x["hidden"], x["weight"], x["target"], x["bias"],
                                           softcap=5.0, z_loss=1e-2, reduction=reduction)
    assert torch.equal(loss.detach(), plain)
    _, _, lse, argmax = reference(x["hidden"], x["weight"], x["target"], x["bias"],
                                  softcap=5.0)
    assert rel_err(stats.lse, lse) <= _tol(torch.float32, 13)
    assert torch.equal(stats.argmax, argmax)
    # every token's entropy, the ignored ones' too
    assert rel_err(stats.entropy, _entropy(x["hidden"], x["weight"], x["bias"], 5.0)) \
        <= _tol(torch.float32, 13)
    valid = x["target"] != -100
    zl = torch.where(valid, lse ** 2, 0.0) * 1e-2
    want = {"none": zl, "sum": zl.sum(), "mean": zl.sum() / valid.sum()}[reduction]
    assert rel_err(stats.z_loss, want) <= _tol(torch.float32, 13)
    loss.sum().backward()  # the statistics carry no gradient; the loss's is unchanged
    assert h.grad is not None and not stats.lse.requires_grad
    assert not stats.entropy.requires_grad


def _entropy(hidden, weight, bias=None, softcap=None):
    """Every row's entropy of softcap(hidden @ weight.T + bias) in float64."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("backend", ["op", "torch_rows", "triton_rows"])
@pytest.mark.parametrize("softcap", [None, 150.0])
def test_ce_token_entropy_of_confident_rows_keeps_float32_precision(backend, softcap):
    # lse about 70, many rows with p(target) > 0.98 (entropies of 1e-4..1e-1), odd V,
    # ignored tokens: the entropy is formed relative to the row max (log s - sum e (z -
    # m) / s), so its error is float32's on those rows, not lse's rounding (about 4e-6,
    # which lse - sum p z would carry). Within twice torch's float32 composition's error
    # from float64, on the loss's stats-only and gradient paths alike.
    h, w, target = (t.to(DEVICE) for t in confident_inputs(48, 24, 257))
    target[::5] = -100
    truth = _entropy(h, w, softcap=softcap)
    z = F.linear(h, w)
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    torch_f32 = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    confident = truth < 5e-2
    assert confident.sum() >= 10
    if backend == "op":
        got = [torch_fce.linear_cross_entropy(h, w, target, softcap=softcap, reduction=r,
                                              return_stats=True)[1].entropy
               for r in ("none", "sum")]  # the stats-only and the gradient path
    else:
        rows = {"torch_rows": TORCH_CE_ROWS, "triton_rows": TRITON_CE_ROWS}[backend]
        opts = CEOptions(softcap=softcap)
        scales = (torch.ones(48, device=DEVICE), torch.zeros(48, device=DEVICE))
        got = [rows.stats(F.linear(h, w), target, None, opts, True, torch.float32).entropy,
               rows.stats_then_grad(F.linear(h, w), target, None, scales, opts, True,
                                    torch.float32, torch.float32)[0].entropy]
    torch_err = (torch_f32.double() - truth).abs()
    for ent in got:
        err = (ent.double() - truth).abs()
        assert err.max() <= 2 * torch_err.max() + 1e-8
        # lse - sum p z: 1.6e-5 on the confident rows, 25x torch's error there
        assert err[confident].max() <= 2 * torch_err[confident].max() + 1e-8


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_triton_ce_rows_argmax_matches_pytorch(softcap):
    logits = torch.randn(6, 5000, device=DEVICE) * 3  # more than one BLOCK_V block
    logits[2, 4500] = 50.0  # the maximum in the second block
    target = torch.randint(0, 5000, (6,), device=DEVICE)
    opts = CEOptions(softcap=softcap)
    got = TRITON_CE_ROWS.stats(logits.clone(), target, None, opts, True, torch.float32)[3]
    want = TORCH_CE_ROWS.stats(logits.clone(), target, None, opts, True, torch.float32)[3]
    assert torch.equal(got, want) and got[2] == 4500


@pytest.mark.cuda
def test_cuda_logprobs_graph_capture_without_host_sync():
    # Real vocabulary, bf16, per-token temperatures: a captured forward+backward replays
    # on new inputs and matches the reference; no call synchronises with the host.
    x = make_inputs(512, 64, 50257, torch.bfloat16, device="cuda", weight_scale=2.0)
    h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    t, T = x["target"].clone(), torch.rand(512, device="cuda") + 0.5
    g_lp, g_h = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")

    def step():
        h.grad = w.grad = None
        out = torch_fce.linear_logprobs(h, w, t, temperature=T, softcap=30.0, entropy=True)
        ((out.logprob * g_lp).sum() + (out.entropy * g_h).sum()).backward()
        return out.logprob

    with no_host_sync():
        graph, static = capture_cuda_graph(step)
    y = make_inputs(512, 64, 50257, torch.bfloat16, device="cuda", seed=1)
    with torch.no_grad():
        h.copy_(y["hidden"])
        t.copy_(y["target"])
    graph.replay()
    torch.cuda.synchronize()
    ref_h = h.detach().double().requires_grad_()
    ref = reference(ref_h, w.detach(), t, temperature=T, softcap=30.0)
    ((ref[0] * g_lp.double()).sum() + (ref[1] * g_h.double()).sum()).backward()
    assert rel_err(static, ref[0]) <= _tol(torch.bfloat16, 50257)
    assert rel_err(h.grad, ref_h.grad) <= 4 * _tol(torch.bfloat16, 50257)


@pytest.mark.parametrize("backend", ["op", "policy", "triton_rows", "torch_rows"])
@pytest.mark.parametrize("V", [257, 37])  # fewer tokens than classes (vocabulary tiles), more
def test_linear_logprobs_confident_values_keep_float32_precision(backend, V):
    # lse about 70 with p(target) > 0.999: the log-prob is formed as (z_y - m) - log s,
    # so its error is that of log s (1e-7), not half a float32 step of lse (2.4-3.9e-6
    # when formed as z_y - lse, swamping values of 1e-9..1e-3). Within twice the error of
    # torch's float32 log_softmax on those rows, against float64 from the same inputs.
    h, w, target = (t.to(DEVICE) for t in confident_inputs(48, 24, V))
    truth = F.linear(h.double(), w.double()).log_softmax(-1).gather(-1, target[:, None])[:, 0]
    torch_f32 = F.linear(h, w).log_softmax(-1).gather(-1, target[:, None])[:, 0]
    confident = truth > -1e-3
    assert confident.sum() >= 10
    if backend == "op":
        got = torch_fce.linear_logprobs(h, w, target).logprob
    elif backend == "policy":
        got = torch_fce.linear_policy_loss(h, w, target, torch.ones(48, device=DEVICE))[1].logprob
    else:
        with chunks(16, h, w):
            got = linear_logprobs.fwd(h, w, target, None, None, *LogProbOptions(),
                                      *ONE_DEVICE, backend=BACKENDS[backend])[0]
    err, torch_err = ((x.double() - truth)[confident].abs().max() for x in (got, torch_f32))
    assert err <= 2 * torch_err + 1e-9, (err, torch_err)

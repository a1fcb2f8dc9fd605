"""linear_distillation_loss against a float64 reference built from both heads' logits
with TRL's generalized JSD (beta 0, 1 and between), hard loss, temperatures (float and
per token), token weights, logit scales, softcaps, biases, differing hidden sizes,
ignored and all-ignored tokens, no target, shift, several chunks; float32 logits of bf16
inputs as exact as the float32 composition, on confident rows at large magnitude;
gradcheck; opcheck; compile; bad input named."""


import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.ops import linear_distillation
from torch_fce.testing import rel_err
from tests.references import distillation_reference as reference

from tests.helpers import ONE_DEVICE, TRITON, chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(draw, dtype=torch.float64):
    N = draw(st.integers(1, 14))
    D, Dt = draw(st.integers(1, 7)), draw(st.integers(1, 9))
    V = draw(st.sampled_from([1, 2, 7, 37, 61]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    scale = draw(st.sampled_from([1.0, 4.0]))
    x = dict(h=r(N, D), w=r(V, D, scale=scale), b=r(V) if draw(st.booleans()) else None,
             ht=r(N, Dt), wt=r(V, Dt, scale=scale),
             bt=r(V) if draw(st.booleans()) else None)
    has_target = draw(st.booleans())
    target = None
    if has_target:
        target = torch.randint(0, V, (N,), generator=g)
        ignore = draw(st.sampled_from([0.0, 0.3, 1.0]))
        target[torch.rand(N, generator=g) < ignore] = -100
    beta = draw(st.sampled_from([0.0, 1.0, 0.5, 0.1, 0.9]))
    opts = dict(beta=beta)
    if draw(st.booleans()):
        opts["temperature"] = draw(st.sampled_from([0.7, 2.0]))
    elif draw(st.booleans()):
        opts["temperature"] = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    if has_target and draw(st.booleans()):
        opts["hard_weight"] = 0.7
    if draw(st.booleans()):
        opts["token_weights"] = torch.rand(N, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        opts.update(logit_scale=0.6, teacher_logit_scale=1.4)
    if draw(st.booleans()):
        opts.update(softcap=3.0, teacher_softcap=draw(st.sampled_from([None, 5.0])))
    return x, target, opts


@st.composite
def problems(draw):
    return _problem(draw)


def _ours(x, target, opts, leaves):
    h, w, b = leaves
    return torch_fce.linear_distillation_loss(h, w, x["ht"], x["wt"], target, b, x["bt"],
                                              **opts)


def _leaves(x, device=DEVICE):
    return [None if t is None else t.to(device).requires_grad_()
            for t in (x["h"], x["w"], x["b"])]


def _grads(loss, leaves):
    want = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(loss, want))
    return [None if t is None else next(got) for t in leaves]


@given(problems())
def test_linear_distillation_loss_matches_the_float64_reference(problem):
    x, target, opts = problem
    x = {k: None if v is None else v.to(DEVICE) for k, v in x.items()}
    target = None if target is None else target.to(DEVICE)
    opts = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    V = x["w"].shape[0]
    leaves = _leaves(x)
    # about three tokens per chunk (the row math's float64 temporaries included)
    with torch_fce.workspace(3 * V * 64):
        loss, stats = _ours(x, target, opts, leaves)
    grads = _grads(loss, leaves)
    ref_leaves = _leaves(x)
    ref_opts = {k: v for k, v in opts.items()}
    want, div, ent = reference(*ref_leaves[:2], ref_leaves[2], x["ht"], x["wt"], x["bt"],
                               target, **ref_opts)
    want_grads = _grads(want, ref_leaves)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))
    assert torch.allclose(stats.divergence, div, rtol=1e-10, atol=1e-12)
    assert torch.allclose(stats.entropy, ent, rtol=1e-10, atol=1e-12)
    for got, ref in zip(grads, want_grads):
        if ref is not None:
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12)


@given(problems(), st.sampled_from([1, 3, 64]), st.sampled_from([torch.float32, None]))
def test_triton_rows_match_the_float64_reference(problem, rows, logits_dtype):
    # The Triton row kernel on the loop (the interpreter off the GPU), float32 inputs:
    # loss, statistics and every gradient within float32 rounding of float64 on the
    # same inputs; None: the logits in the inputs' dtype, dz written over them.
    x, target, opts = problem
    x = {k: None if v is None else v.float().to(DEVICE) for k, v in x.items()}
    target = None if target is None else target.to(DEVICE)
    opts = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    N = x["h"].shape[0]
    T = opts.pop("temperature", None)
    T = None if T is None else torch.as_tensor(T, dtype=torch.float32, device=DEVICE
                                               ).expand(N).contiguous()
    tw = opts.pop("token_weights", None)
    tw = None if tw is None else tw.float()
    rec = linear_distillation.DistillOptions(**opts, logits_dtype=logits_dtype)
    needs = [True, True, x["b"] is not None]
    with chunks(rows, x["h"], x["w"]):
        loss, gh, gw, gb, div, ent = linear_distillation.fwd(
            x["h"], x["w"], x["ht"], x["wt"], target, x["b"], x["bt"], tw, T, *rec, *ONE_DEVICE,
            needs,
            backend=TRITON)
    leaves = [None if t is None else t.double().requires_grad_()
              for t in (x["h"], x["w"], x["b"])]
    wide = {k: None if v is None else v.double() for k, v in x.items()}
    want, want_div, want_ent = reference(*leaves[:2], leaves[2], wide["ht"], wide["wt"],
                                         wide["bt"], target, temperature=1.0 if T is None
                                         else T.double(), token_weights=tw, **opts)
    want_grads = _grads(want, leaves)

    def err(a, b, floor):  # relative, but absolute below floor (a divergence of 0)
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).norm() / max(float(b.norm()), floor))

    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert err(div, want_div, 1.0) <= 1e-5 and err(ent, want_ent, 1.0) <= 1e-5
    for got, ref in zip((gh, gw, gb), want_grads):
        if ref is not None:
            assert err(got, ref, 1e-3) <= 1e-5, err(got, ref, 1e-3)


def test_linear_distillation_loss_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in
               ((2, 3, 4), (9, 4), (9,)))
    ht, wt = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), \
        torch.randn(9, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 9, (2, 3), generator=g)
    T = torch.rand(2, 3, generator=g, dtype=torch.float64) + 0.5
    for beta in (0.0, 0.4, 1.0):
        def fn(h, w, b):
            return torch_fce.linear_distillation_loss(
                h, w, ht, wt, y, b, beta=beta, temperature=T, hard_weight=0.3,
                softcap=4.0, teacher_softcap=3.0, logit_scale=0.8)[0]
        torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_(),
                                      b.requires_grad_()))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float32_logits_of_bf16_inputs_on_confident_rows_at_large_magnitude(beta):
    # Logits around 20 +- 20 on both heads, most rows p > 0.98: the default (float32
    # logits from the GEMMs) is as close to float64 as TRL's kernel's precision, the
    # float32 composition whose logits gradient is rounded to bf16 for the gradient
    # GEMMs (as ours and TRL's are), and far closer than logits rounded to bf16.
    g = torch.Generator().manual_seed(5)
    N, D, Dt, V = 48, 24, 40, 257

    def head(D):
        w = torch.randn(V, D, generator=g, dtype=torch.float64)
        h = torch.randn(N, D, generator=g, dtype=torch.float64) * 20.0 / D ** 0.5
        w[:, 0], h[:, 0] = 20.0, 1.0
        return h.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE)

    (h, w), (ht, wt) = head(D), head(Dt)
    y = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    opts = dict(beta=beta, hard_weight=0.5, temperature=0.8)

    def composition(wide, round_dz):
        hh, ww = (t.to(wide) for t in (h, w))
        z = (hh @ ww.T).requires_grad_()
        zt = ht.to(wide) @ wt.to(wide).T
        loss = reference(z, torch.eye(V, dtype=wide, device=DEVICE), None, zt,
                         torch.eye(V, dtype=wide, device=DEVICE), None, y, wide=wide,
                         **opts)[0]
        dz, = torch.autograd.grad(loss, z)
        if round_dz:
            dz = dz.bfloat16().to(wide)
        return [loss.detach().double(), (dz @ ww).double(), (dz.T @ hh).double()]

    def ours(logits_dtype):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = torch_fce.linear_distillation_loss(*leaves, ht, wt, y,
                                                  logits_dtype=logits_dtype, **opts)[0]
        return [loss.detach().double()] + [gr.double() for gr in
                                           torch.autograd.grad(loss, leaves)]

    truth, trl = composition(torch.float64, False), composition(torch.float32, True)
    got, rounded = ours(torch.float32), ours(None)
    floor = 1e-6 if DEVICE == "cuda" else 1e-7  # the GPU's float32 GEMM and exp/log
    for name, a, c, t in zip(("loss", "hidden", "weight"), got, trl, truth):
        # the gradients: ours end rounded to bf16 (2^-9 relative) where TRL's float32
        # sums here do not
        room = 2.0 ** -8 if name != "loss" else 0.0
        assert rel_err(a, t) <= 2 * rel_err(c, t) + floor + room, \
            (name, rel_err(a, t), rel_err(c, t))
    assert rel_err(got[0], truth[0]) < rel_err(rounded[0], truth[0]) / 4


def test_no_target_shift_all_ignored_teacher_untouched_and_inputs_unchanged():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(2, 4, 3, generator=g), torch.randn(11, 3, generator=g)
    ht, wt = torch.randn(2, 4, 5, generator=g), torch.randn(11, 5, generator=g)
    y = torch.randint(0, 11, (2, 4), generator=g)
    copies = [t.clone() for t in (h, w, ht, wt, y)]
    wt_leaf = wt.clone().requires_grad_()
    loss, _ = torch_fce.linear_distillation_loss(h.requires_grad_(), w, ht, wt_leaf)
    loss.backward()
    assert wt_leaf.grad is None  # the teacher receives no gradient
    want = reference(h.double(), w.double(), None, ht.double(), wt.double(), None, None)[0]
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    # shift pairs position t with target t + 1 (the last position not counted)
    shifted = torch.cat([y[:, 1:], torch.full((2, 1), -100)], 1)
    a = torch_fce.linear_distillation_loss(h, w, ht, wt, y, shift=True, hard_weight=1.0)
    b = torch_fce.linear_distillation_loss(h, w, ht, wt, shifted, hard_weight=1.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].divergence, b[1].divergence)
    assert all(torch.equal(u, v) for u, v in zip(copies, (h.detach(), w, ht, wt, y)))
    h0 = h.detach().clone().requires_grad_()
    loss, stats = torch_fce.linear_distillation_loss(h0, w, ht, wt, torch.full_like(y, -100))
    loss.backward()
    assert loss.item() == 0.0 and float(h0.grad.abs().max()) == 0.0
    assert float(stats.divergence.abs().max()) == 0.0 == float(stats.entropy.abs().max())


def _small(dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(3)
    return [t.to(dtype).to(device) for t in (
        torch.randn(3, 4, 8, generator=g), torch.randn(37, 8, generator=g),
        torch.randn(3, 4, 6, generator=g), torch.randn(37, 6, generator=g))] + \
        [torch.randint(0, 37, (3, 4), generator=g).to(device)]


def test_linear_distillation_loss_compiled_fullgraph_dynamic_matches_eager():
    h, w, ht, wt, y = _small()
    T = torch.rand(3, 4, device=DEVICE) + 0.5

    def step(h, w):
        loss, stats = torch_fce.linear_distillation_loss(
            h, w, ht, wt, y, beta=0.5, temperature=T, hard_weight=0.2, softcap=4.0)
        return loss, stats.entropy

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    out = []
    for fn in (compiled, step):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss, ent = fn(*leaves)
        out.append([loss.detach(), ent] + list(torch.autograd.grad(loss, leaves)))
    for a, b in zip(*out):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("accumulator", ["fp32", "kahan", "input"])
def test_linear_distillation_loss_opcheck(accumulator):
    h, w, ht, wt, y = _small(torch.bfloat16, "cpu")
    torch.library.opcheck(
        torch.ops.fce.linear_distillation_loss.default,
        (h.requires_grad_(), w.requires_grad_(), ht, wt, y),
        dict(beta=0.3, hard_weight=0.5, accumulator=accumulator, logits_dtype=torch.float32))


_BAD = [
    (dict(beta=1.5), ValueError, "beta"),
    (dict(beta="x"), TypeError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(hard_weight=-1.0), ValueError, "hard_weight"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(teacher_softcap=-2.0), ValueError, "teacher_softcap"),
    (dict(accumulator="bf16"), ValueError, "accumulator"),
    (dict(logits_dtype=torch.float16), ValueError, "logits_dtype"),
    (dict(token_weights=torch.ones(5)), ValueError, "token_weights"),
]


@pytest.mark.parametrize("options, error, named", _BAD, ids=[b[2] + str(i) for i, b in
                                                            enumerate(_BAD)])
def test_bad_options_are_named(options, error, named):
    h, w, ht, wt, y = _small(device="cpu")
    with pytest.raises(error, match=named):
        torch_fce.linear_distillation_loss(h, w, ht, wt, y, **options)


def test_bad_tensors_are_named():
    h, w, ht, wt, y = _small(device="cpu")
    cases = [
        ((h, w, ht, torch.randn(38, 6), y), {}, ValueError, "teacher_weight has 38 classes "
                                                            "and weight 37"),
        ((h, w, ht[:, :3], wt, y), {}, ValueError, "teacher_hidden"),
        ((h, w, ht, torch.randn(37, 5), y), {}, ValueError, "teacher_weight"),
        ((h, w, ht, wt, None), dict(hard_weight=1.0), ValueError, "hard_weight"),
        ((h, w, ht, wt, None), dict(shift=True), ValueError, "shift"),
        ((h, w, ht, wt.long(), y), {}, TypeError, "teacher_weight"),
        ((h, w, "x", wt, y), {}, TypeError, "teacher_hidden"),
        ((h, w, ht, wt, y), dict(bias=torch.zeros(37, dtype=torch.float64)), TypeError,
         "bias"),
        ((h, w, ht, wt, y.float()), {}, TypeError, "target"),
        ((h, w, ht, wt, y), dict(teacher_bias=torch.randn(36)), ValueError, "teacher_bias"),
    ]
    for args, options, error, named in cases:
        with pytest.raises(error, match=named):
            torch_fce.linear_distillation_loss(*args, **options)


@pytest.mark.cuda
def test_linear_distillation_loss_on_cuda_has_no_host_sync():
    from tests.helpers import no_host_sync

    h, w, ht, wt, y = _small(torch.bfloat16, "cuda")
    leaves = [h.requires_grad_(), w.requires_grad_()]
    with no_host_sync():
        loss, _ = torch_fce.linear_distillation_loss(*leaves, ht, wt, y, beta=0.5,
                                                     hard_weight=0.1)
        loss.backward()
    want = reference(h.double(), w.double(), None, ht.double(), wt.double(), None, y,
                     beta=0.5, hard_weight=0.1)[0]
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())

"""logits_dtype=torch.float32: the GEMM's float32 sums, unrounded, for low-precision
inputs, on every op, both row backends (Triton's under the interpreter on CPU), token
chunks and vocabulary tiles. Against float64 truth from the same bfloat16/float16
values: within twice the error of F.linear(hidden.float(), weight.float())'s
composition, values and gradients (gradients rounded to the inputs' dtype on both
sides), and far below the rounded logits' error."""

import pytest
import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.ops.machinery import dispatch
from torch_fce.testing import rel_err

from tests.helpers import BACKENDS, chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g) * 3
    w = torch.randn(V, D, generator=g)
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    return [x.to(DEVICE, dtype) for x in (h, w, b)] + [t.to(DEVICE)]


def _objectives(t, z64):
    """name -> fn(h, w, b, logits) of a scalar, logits (N, V) in float32 or float64
    (the composition) or None (torch_fce, given logits_dtype)."""
    N = t.shape[0]
    g = torch.Generator().manual_seed(7)
    up = (torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE))
    temp = torch.linspace(0.5, 1.5, N, device=DEVICE)
    adv = torch.randn(N, generator=g).to(DEVICE)
    valid = t != -100

    def logp(z, T=1.0):
        return (z / T).log_softmax(-1).gather(-1, t.clamp_min(0)[:, None])[:, 0]

    # old log-probs near the policy's (some ratios clip): the loss depends on logprob
    old = (logp(z64, 0.7) + 0.2 * torch.randn(N, generator=g, dtype=torch.float64).to(
        DEVICE)).float()

    def ce(h, w, b, ld, z=None):
        if z is None:
            return torch_fce.linear_cross_entropy(h, w, t, b, label_smoothing=0.1,
                                                  softcap=20.0, logits_dtype=ld)
        z = 20.0 * torch.tanh(z / 20.0)
        return F.cross_entropy(z, t, label_smoothing=0.1)

    def ce_none(h, w, b, ld, z=None):
        loss = torch_fce.linear_cross_entropy(h, w, t, b, reduction="none", logits_dtype=ld) \
            if z is None else F.cross_entropy(z, t, reduction="none")
        return (loss * up[0]).sum()

    def logprobs(h, w, b, ld, z=None):
        if z is None:
            out = torch_fce.linear_logprobs(h, w, t, b, temperature=temp, entropy=True,
                                            logits_dtype=ld)
            lp, ent = out.logprob, out.entropy
        else:
            lq = (z / temp[:, None]).log_softmax(-1)
            lp = torch.where(valid, logp(z, temp[:, None]), 0.0)
            ent = torch.where(valid, -(lq.exp() * lq).sum(-1), 0.0)
        return (lp * up[0]).sum() + (ent * up[1]).sum()

    def policy(h, w, b, ld, z=None):
        if z is None:
            return torch_fce.linear_policy_loss(h, w, t, adv, b, old_logprobs=old,
                                                logits_dtype=ld, temperature=0.7)[0]
        lp = logp(z, 0.7)
        r = torch.exp(lp - old.to(lp.dtype))
        per = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.2) * adv)
        return torch.where(valid, per, 0.0).sum() / valid.sum()

    return dict(ce=ce, ce_none=ce_none, logprobs=logprobs, policy=policy)


def _run(fn, leaves, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    value = fn(*leaves, **kw)
    return [value.detach()] + list(torch.autograd.grad(value, leaves))


@pytest.mark.parametrize("backend", ["torch_rows", "triton_rows"])
@pytest.mark.parametrize("objective", ["ce", "ce_none", "logprobs", "policy"])
@pytest.mark.parametrize("N, V", [(40, 301), (64, 37)])  # vocabulary tiles, token chunks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_logits_as_exact_as_the_float32_composition(monkeypatch, backend, objective,
                                                            N, V, dtype):
    monkeypatch.setattr(dispatch, "backend_for", lambda hidden: BACKENDS[backend])
    h, w, b, t = _inputs(N, 16, V, dtype)
    fn = _objectives(t, F.linear(h.double(), w.double(), b.double()))[objective]

    def composition(wide):  # leaves of the same values in the wide dtype
        return _run(lambda h, w, b: fn(h, w, b, None, F.linear(h, w, b)),
                    [x.to(wide) for x in (h, w, b)])

    truth = composition(torch.float64)
    f32 = composition(torch.float32)
    f32 = f32[:1] + [g.to(dtype) for g in f32[1:]]  # gradients rounded as ours are
    with chunks(12, h, w):  # several chunks or tiles
        ours = _run(lambda h, w, b: fn(h, w, b, torch.float32), (h, w, b))
        rounded = _run(lambda h, w, b: fn(h, w, b, None), (h, w, b))
    # Triton's CPU interpreter rounds float32 to bfloat16 by truncation (twice the error
    # of rounding to nearest, measured), so there dz's rounding gets twice the room.
    room = 4 if backend == "triton_rows" and DEVICE == "cpu" and dtype == torch.bfloat16 \
        else 2
    # On the GPU the values come to a few float32 steps of the row's log-sum-exp on both
    # backends (Triton's exp2 / log2 are the hardware's approximations; cuBLAS's
    # float32-output GEMM of bf16 operands sums in its own order): 1.9e-7 to 2.8e-7
    # relative measured on an H200, far below the 1e-3 of logits rounded to bf16 or fp16.
    floor = 1e-6 if DEVICE == "cuda" else 1e-7
    if objective == "policy" and dtype == torch.float16:
        # a signed sum of advantage-weighted terms: cancellation lifts the value's relative
        # error (4.5e-6 measured on CPU for float16, the float32 composition's 2.2e-6)
        floor = max(floor, 1e-6)
    for name, a, c, r, rd in zip(("value", "hidden", "weight", "bias"), ours, f32, truth,
                                 rounded):
        assert a.dtype == rd.dtype, name
        err, bar = rel_err(a.double(), r), rel_err(c.double(), r)
        assert err <= room * bar + floor, (name, err, bar)
    # the value itself: far more exact than from logits rounded to the inputs' dtype, down
    # to the float32 floor (a mean of few rounded tokens can cancel to 4e-7 relative, which
    # the GPU's float32 value, at 1.2e-7 measured, cannot beat fourfold)
    assert rel_err(ours[0].double(), truth[0]) < (rel_err(rounded[0].double(), truth[0])
                                                  + floor) / 4


def test_float32_logits_compile_and_leave_wide_inputs_alone():
    h, w, b, t = _inputs(24, 8, 53, torch.bfloat16)

    def step(h, w, b):
        out = torch_fce.linear_logprobs(h, w, t.reshape(2, 12), b, entropy=True,
                                        logits_dtype=torch.float32)
        return (out.logprob.sum() + out.entropy.sum()
                + torch_fce.linear_cross_entropy(h, w, t.reshape(2, 12), b,
                                                 logits_dtype=torch.float32))

    hs = h.reshape(2, 12, 8)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for a, c in zip(_run(compiled, (hs, w, b)), _run(step, (hs, w, b))):
        assert rel_err(a.double(), c.double()) <= 1e-6
    # float32 inputs: the option changes nothing, bit for bit
    x = [v.float() for v in (h, w, b)]
    same = [_run(lambda h, w, b: torch_fce.linear_cross_entropy(h, w, t, b, logits_dtype=ld),
                 x) for ld in (None, torch.float32)]
    assert all(torch.equal(a, c) for a, c in zip(*same))


def test_float32_logits_opcheck_and_bad_value_named():
    h, w, b, t = _inputs(6, 4, 9, torch.bfloat16)
    h.requires_grad_(), w.requires_grad_()
    torch.library.opcheck(torch.ops.fce.linear_ce.default, (h, w, t, b, None),
                          dict(logits_dtype=torch.float32))
    torch.library.opcheck(torch.ops.fce.linear_logprobs.default, (h, w, t, b, None),
                          dict(logits_dtype=torch.float32, entropy=True))
    for fn in (torch_fce.linear_cross_entropy, torch_fce.linear_logprobs):
        with pytest.raises(ValueError, match="logits_dtype"):
            fn(h, w, t, logits_dtype=torch.bfloat16)

"""linear_policy_loss against a float64 reference built from the logits with TRL's
formulas and autograd: every loss_type, with and without old/ref log-probs, each KL
estimator, entropy_coef, token_weights, per-token and per-sequence advantages and
temperatures, the KL times the ratio, softcap, bias, ignored tokens; gradcheck;
opcheck; compile; the Triton rows under the interpreter; bad input."""

import pytest
import torch
from hypothesis import given, strategies as st

import torch_fce
from torch_fce.ops import linear_policy_loss
from torch_fce.ops.linear_policy_loss import PolicyOptions
from tests.helpers import ONE_DEVICE, TORCH, TRITON, chunks
from torch_fce.testing import make_inputs, rel_err
from tests.references import policy_reference as reference
from tests.helpers import LOSS_TOL, grad_tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def policy_problems(draw):
    N = draw(st.sampled_from([2, 8, 24]))
    D = draw(st.sampled_from([1, 4, 17]))
    V = draw(st.sampled_from([2, 31, 97, 257]))
    x = make_inputs(N, D, V, torch.float32, ignore_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
                    bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                    weight_scale=draw(st.sampled_from([1.0, 4.0])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    B, T = 2, N // 2
    target = x["target"].reshape(B, T)
    options = dict(loss_type=draw(st.sampled_from(list(linear_policy_loss.LOSS_TYPES))),
                   softcap=draw(st.sampled_from([None, 3.0])),
                   entropy_coef=draw(st.sampled_from([0.0, 0.01])))
    if options["loss_type"] == "clip":
        options.update(epsilon_low=0.2, epsilon_high=draw(st.sampled_from([None, 0.28])),
                       delta=draw(st.sampled_from([None, 1.5])))
    if options["loss_type"] == "cispo":
        options["epsilon_high"] = draw(st.sampled_from([1.1, 5.0]))
    per = draw(st.sampled_from(["scalar", "token", "sequence"]))
    options["temperature"] = {"scalar": draw(st.sampled_from([1.0, 0.7])),
                              "token": torch.rand(B, T, generator=g) + 0.3,
                              "sequence": torch.rand(B, 1, generator=g) + 0.3}[per]
    advantages = draw(st.sampled_from(["sequence", "token"]))
    options["advantages"] = torch.randn(B, generator=g) if advantages == "sequence" else \
        torch.randn(B, T, generator=g)
    with torch.no_grad():  # old / ref log-probs near the current ones: some ratios clip
        leaves = {k: x[k].double() for k in ("hidden", "weight", "bias") if x[k] is not None}
        leaves["hidden"] = leaves["hidden"].reshape(B, T, D)
        _, lp, _ = reference(leaves, target, torch.zeros(()), **{
            k: options[k] for k in ("temperature", "softcap")})
    if draw(st.booleans()):
        options["old_logprobs"] = (lp + 0.3 * torch.randn(B, T, generator=g)).float()
    if draw(st.booleans()):
        options["ref_logprobs"] = (lp + 0.3 * torch.randn(B, T, generator=g)).float()
        options.update(beta=draw(st.sampled_from([0.0, 0.04])),
                       kl=draw(st.sampled_from(["k1", "k2", "k3"])),
                       kl_ratio=draw(st.booleans()))
    if draw(st.booleans()):
        options["token_weights"] = torch.rand(B, T, generator=g)
    return x, target, options


def _run(fn, x, target, options, dtype=torch.float32):
    leaves = {k: x[k].detach().to(DEVICE, dtype).reshape(
        *target.shape, -1) if k == "hidden" else x[k].detach().to(DEVICE, dtype)
        for k in ("hidden", "weight", "bias") if x[k] is not None}
    for t in leaves.values():
        t.requires_grad_()
    out = fn(leaves, target.to(DEVICE), {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                                         for k, v in options.items()})
    grads = torch.autograd.grad(out[0], list(leaves.values()), allow_unused=True)
    return out, dict(zip(leaves, grads))


def _fce(leaves, target, options):
    options = dict(options)
    advantages = options.pop("advantages")
    loss, stats = torch_fce.linear_policy_loss(leaves["hidden"], leaves["weight"], target,
                                               advantages, leaves.get("bias"), **options)
    return loss, stats.logprob, stats.entropy


def _ref(leaves, target, options):
    options = dict(options)
    old, ref = options.pop("old_logprobs", None), options.pop("ref_logprobs", None)
    advantages = options.pop("advantages")
    A = advantages[:, None] if advantages.dim() == 1 else advantages
    return reference(leaves, target, A, old, ref, **options)


@given(policy_problems())
def test_linear_policy_loss_matches_reference(problem):
    x, target, options = problem
    (loss, lp, ent), grads = _run(_fce, x, target, options)
    (ref_loss, ref_lp, ref_ent), ref_grads = _run(_ref, x, target, options, torch.float64)
    V = x["weight"].shape[0]
    scale = max(1.0, float(ref_loss.detach().abs()))
    assert abs(loss.detach().item() - ref_loss.detach().item()) <= 64 * LOSS_TOL * scale
    assert rel_err(lp, ref_lp) <= LOSS_TOL * 8 and rel_err(ent, ref_ent) <= LOSS_TOL * 8
    # The float32 composition's own error sets the bar where a gradient cancels (a bias
    # gradient summed over tokens of both signs), grad_tol elsewhere.
    _, f32_grads = _run(_ref, x, target, options)
    for k, g in ref_grads.items():
        assert (grads[k] is None) == (g is None) or float(g.abs().max()) == 0.0, k
        if g is not None and grads[k] is not None:
            bar = max(grad_tol(torch.float32, V), rel_err(f32_grads[k], g))
            assert rel_err(grads[k], g) <= 4 * bar, k


def test_linear_policy_loss_gradcheck_float64():
    x = make_inputs(6, 4, 9, torch.float64, bias=True)
    target = x["target"].reshape(2, 3)
    g = torch.Generator().manual_seed(0)
    A, old = torch.randn(2, generator=g, dtype=torch.float64), \
        torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.1 - 2.2
    ref = old + 0.1
    # cispo's capped ratio is detached (its gradient is not the loss's derivative)
    for loss_type in [t for t in linear_policy_loss.LOSS_TYPES if t != "cispo"]:
        def fn(h, w, b):
            return torch_fce.linear_policy_loss(
                h, w, target, A, b, old_logprobs=old, ref_logprobs=ref, beta=0.1,
                entropy_coef=0.05, loss_type=loss_type, epsilon_high=3.0, temperature=0.8,
                softcap=5.0)[0]
        torch.autograd.gradcheck(fn, (x["hidden"].reshape(2, 3, 4).requires_grad_(),
                                      x["weight"].requires_grad_(), x["bias"].requires_grad_()))


def test_linear_policy_loss_all_ignored_shift_and_inputs_unchanged():
    x = make_inputs(8, 4, 11, ignore_frac=1.0)
    h = x["hidden"].reshape(2, 4, 4).requires_grad_()
    w = x["weight"].requires_grad_()
    A = torch.randn(2)
    loss, stats = torch_fce.linear_policy_loss(h, w, x["target"].reshape(2, 4), A)
    loss.backward()
    assert loss.detach().item() == 0.0 and float(h.grad.abs().max()) == 0.0
    assert all(float(t.abs().max()) == 0.0 for t in stats)
    # shift: hidden position t predicts target t + 1, the per-token tensors stay with t
    y = make_inputs(8, 4, 11, ignore_frac=0.0, seed=3)
    h, w, t = y["hidden"].reshape(2, 4, 4), y["weight"], y["target"].reshape(2, 4)
    copies = [v.clone() for v in (h, w, t, A)]
    shifted = torch.cat([t[:, 1:], torch.full((2, 1), -100)], 1)
    a = torch_fce.linear_policy_loss(h, w, t, A, shift=True, loss_type="reinforce")
    b = torch_fce.linear_policy_loss(h, w, shifted, A, loss_type="reinforce")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].logprob, b[1].logprob)
    assert all(torch.equal(u, v) for u, v in zip(copies, (h, w, t, A)))


def test_linear_policy_loss_beta_0_kl_is_a_statistic_and_cispo_clips_as_trl():
    # ref_logprobs with beta 0 only reports the KL: a -inf or NaN reference log-prob
    # cannot reach the loss or the gradients (as TRL skips the KL term at beta 0)
    x = make_inputs(6, 4, 9)
    h, w, t = x["hidden"].reshape(2, 3, 4), x["weight"], x["target"].reshape(2, 3)
    g = torch.Generator().manual_seed(4)
    A, old = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g) * 0.3 - 2.2
    ref = old.clone()
    ref[0, 1], ref[1, 2] = float("-inf"), float("nan")

    def run(**options):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss, stats = torch_fce.linear_policy_loss(*leaves, t, A, old_logprobs=old,
                                                   loss_type="cispo", epsilon_high=1.05,
                                                   **options)
        return loss, stats, torch.autograd.grad(loss, leaves)

    want = run()
    got = run(ref_logprobs=ref, beta=0.0)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    valid = t != -100
    assert not torch.isfinite(got[1].kl[valid & ~torch.isfinite(ref)]).any()
    clipped = (got[1].ratio > 1.05) & (A > 0) & valid  # TRL's cispo_clip_ratio
    assert torch.equal(got[1].clipped, clipped.float())


def _compiled_problem():
    x = make_inputs(12, 8, 37, bias=True, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    target = x["target"].reshape(3, 4)
    old = (torch.randn(3, 4, generator=g) * 0.2 - 3.6).to(DEVICE)
    return x, target, dict(advantages=torch.randn(3, generator=g).to(DEVICE), old_logprobs=old,
                           ref_logprobs=old + 0.05, beta=0.04, entropy_coef=0.01,
                           temperature=0.7, epsilon_high=0.28)


def test_linear_policy_loss_compiled_fullgraph_dynamic_matches_eager():
    x, target, options = _compiled_problem()
    step = torch.compile(_fce, fullgraph=True, dynamic=True)
    (loss, *_), grads = _run(step, x, target, options)
    (want, *_), want_grads = _run(_fce, x, target, options)
    assert rel_err(loss, want) <= 1e-6
    for k in grads:
        assert rel_err(grads[k], want_grads[k]) <= 1e-6, k


@pytest.mark.parametrize("accumulator", ["fp32", "kahan", "input"])
def test_linear_policy_loss_opcheck(accumulator):
    x = make_inputs(6, 4, 9, torch.bfloat16, bias=True)
    g = torch.Generator().manual_seed(0)
    args = (x["hidden"].reshape(2, 3, 4).requires_grad_(), x["weight"].requires_grad_(),
            x["target"].reshape(2, 3), torch.randn(2, 3, generator=g), x["bias"],
            torch.randn(2, 3, generator=g) * 0.1 - 2.2)
    torch.library.opcheck(torch.ops.fce.linear_policy_loss.default, args,
                          dict(entropy_coef=0.01, accumulator=accumulator))


def test_triton_policy_rows_match_their_pytorch_twin():
    # The Triton log-prob rows with the loss's upstream gradients formed between their
    # two sweeps (the interpreter on CPU, the kernel on a GPU), against the PyTorch rows.
    x = {k: v if v is None else v.to(DEVICE) for k, v in make_inputs(
        9, 5, 37, bias=True, ignore_frac=0.3, weight_scale=2.0).items()}
    g = torch.Generator().manual_seed(2)
    A, old = (torch.randn(9, generator=g).to(DEVICE) for _ in range(2))
    opts = PolicyOptions(loss_type="clip", epsilon_low=0.2, epsilon_high=0.28, beta=0.04,
                         kl="k3", kl_ratio=True, entropy_coef=0.01, softcap=4.0)
    args = (x["hidden"], x["weight"], x["target"], A, x["bias"], old - 3.0, old - 3.1, None,
            torch.rand(9, generator=g).to(DEVICE) + 0.5, *opts, *ONE_DEVICE,
            [True, True, True])
    with chunks(4, x["hidden"], x["weight"]):
        got = linear_policy_loss.fwd(*args, backend=TRITON)
        want = linear_policy_loss.fwd(*args, backend=TORCH)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5


BAD = [
    ("loss_type", dict(loss_type="ppo"), ValueError),
    ("kl", dict(kl="k4"), ValueError),
    ("epsilon_low", dict(epsilon_low=-0.1), ValueError),
    ("epsilon_high", dict(epsilon_high=float("nan")), ValueError),
    ("delta", dict(delta=0.0), ValueError),
    ("sapo_temperature_neg", dict(sapo_temperature_neg=0.0), ValueError),
    ("beta", dict(beta=-1.0), ValueError),
    ("ref_logprobs", dict(beta=0.1), ValueError),
    ("entropy_coef", dict(entropy_coef=float("inf")), ValueError),
    ("old_logprobs", dict(old_logprobs=torch.zeros(5)), ValueError),
    ("token_weights", dict(token_weights=torch.zeros(2, 3, dtype=torch.int64)), TypeError),
    ("old_logprobs", dict(old_logprobs=torch.zeros(2, 3, requires_grad=True)), ValueError),
    ("temperature", dict(temperature=0.0), ValueError),
    ("accumulator", dict(accumulator="bf16"), ValueError),
]


@pytest.mark.parametrize("argument,options,error", BAD, ids=[f"{b[0]}-{i}"
                                                            for i, b in enumerate(BAD)])
def test_linear_policy_loss_bad_input_names_argument(argument, options, error):
    x = make_inputs(6, 4, 5)
    with pytest.raises(error, match=argument):
        torch_fce.linear_policy_loss(x["hidden"].reshape(2, 3, 4), x["weight"],
                                     x["target"].reshape(2, 3), torch.randn(2), **options)
    with pytest.raises(TypeError, match="bias"):  # float64 beside float32 operands
        torch_fce.linear_policy_loss(x["hidden"], x["weight"], x["target"], torch.randn(6),
                                     torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="advantages"):
        torch_fce.linear_policy_loss(x["hidden"], x["weight"], x["target"], torch.randn(4))


def test_loss_types_are_the_table_and_docs_rl_lists_each():
    # one table (LOSS_TYPES: name -> formula); docs/rl.md's rows are its names, in order
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    table = text.split("| loss_type | policy term |", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r'^\| `"(\w+)"`', table, re.M) == list(linear_policy_loss.LOSS_TYPES)
    with pytest.raises(ValueError, match="loss_type"):  # no type falls through
        PolicyOptions(loss_type="ppo").check()

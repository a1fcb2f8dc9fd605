"""The Inductor pass: every supported pattern fuses and matches eager; others stay."""

import collections
import contextlib
import warnings

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_fce.lowering as lowering
from torch_fce.testing import rel_err
from tests.helpers import grad_tol

# The GPU tier runs the pass under Inductor's CUDA backend (README); CI on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D, V = 16, 37


@pytest.fixture(autouse=True)
def _fresh():
    # Every test compiles afresh, so the counters it asserts count this test's compiles.
    torch._dynamo.reset()
    counters.clear()
    with lowering.fresh_compiles():
        yield
    torch._dynamo.reset()


class Head(nn.Module):
    """A (B, T, D) hidden state and an lm head; `loss` picks how the loss is written."""

    def __init__(self, loss):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, V)  # with a bias: its gradient is checked too
        self.padded = nn.Linear(D, V + 11)  # a vocabulary padded for speed: V real rows
        self.loss = loss
        self.register_buffer("class_weight", torch.rand(V) + 0.5)
        self.to(DEVICE)

    def forward(self, x, labels, n=None):
        return self.loss(self, torch.tanh(self.proj(x)), labels, n)


def _hf_causal_lm(m, h, labels, n):
    # transformers' ForCausalLMLoss: upcast, pad + shift labels, sum / num_items_in_batch.
    logits = m.head(h).float()
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100,
                           reduction="sum")
    return loss / n


PATTERNS = {
    "F.linear+bias": (lambda m, h, y, n: F.cross_entropy(
        F.linear(h, m.head.weight, m.proj.bias.new_zeros(V) + 0.1).flatten(0, 1),
        y.flatten())),
    "nn.Linear+float+view+ignore": (lambda m, h, y, n: F.cross_entropy(
        m.head(h).float().view(-1, V), y.view(-1).clamp_min(0), ignore_index=3)),
    "matmul_T+CrossEntropyLoss(weight, smoothing, sum)": (lambda m, h, y, n: nn.CrossEntropyLoss(
        weight=m.class_weight, label_smoothing=0.1, reduction="sum")(
            (h @ m.head.weight.T).reshape(-1, V), y.reshape(-1))),
    "to(float32)+reshape+none": (lambda m, h, y, n: F.cross_entropy(
        m.head(h).to(torch.float32).reshape(-1, V), y.reshape(-1), reduction="none").sum()),
    "hf_causal_lm": _hf_causal_lm,
    "slice_shift": (lambda m, h, y, n: F.cross_entropy(
        m.head(h)[..., :-1, :].contiguous().view(-1, V), y[..., 1:].contiguous().view(-1))),
    "gemma_softcap": (lambda m, h, y, n: F.cross_entropy(
        (torch.tanh(m.head(h) / 5.0) * 5.0).float().view(-1, V), y.view(-1))),
    "aten_cross_entropy_loss(sum)": (lambda m, h, y, n: torch._C._nn.cross_entropy_loss(
        m.head(h).view(-1, V), y.view(-1), None, 2, -100, 0.0)),
    "F.linear(keywords)+negative_softcap": (lambda m, h, y, n: F.cross_entropy(
        (torch.tanh(F.linear(input=h, weight=m.head.weight) / -5.0) * -5.0).view(-1, V),
        y.view(-1))),
    # A head padded to a multiple of 16 whose padding is sliced off, labels ignored as -1.
    "padded_vocab_slice+ignore-1": (lambda m, h, y, n: F.cross_entropy(
        m.padded(h)[..., :V].float().reshape(-1, V), y.masked_fill(y == -100, -1).view(-1),
        ignore_index=-1)),
    "padded_vocab_slice+shift": (lambda m, h, y, n: F.cross_entropy(
        m.padded(h)[:, :-1, :V].contiguous().view(-1, V), y[:, 1:].reshape(-1))),
}

# Heads as training codebases write them (docs/lowering.md, "Heads in the wild").
def _nanochat(m, h, y, n):
    # nanochat (gpt.py): vocab padded to 64 and sliced back, the head's weight cast to the
    # activations' dtype, float32 softcap 15 * tanh(x / 15), ignore_index=-1.
    logits = F.linear(h, m.padded.weight.to(dtype=h.dtype))
    logits = logits[..., :V].float()
    logits = 15 * torch.tanh(logits / 15)
    return F.cross_entropy(logits.view(-1, logits.size(-1)),
                           y.masked_fill(y == -100, -1).view(-1), ignore_index=-1)


def _modded_nanogpt_tanh(m, h, y, n):
    # modded-nanogpt (January 2025): tanh softcap on the padded head, padding kept.
    logits = m.padded(h)
    logits = 15 * torch.tanh(logits / 15)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1).clamp_min(0))


def _llm_c(m, h, y, n):
    # llm.c (train_gpt2.py) with return_logits=False: the logits are dropped.
    logits = m.head(h)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)),
                           y.masked_fill(y == -100, -1).view(-1), ignore_index=-1)
    logits = None
    return loss


WILD = {"nanochat": _nanochat, "modded-nanogpt (tanh)": _modded_nanogpt_tanh,
        "llm.c (return_logits=False)": _llm_c}


@pytest.mark.parametrize("name", WILD)
def test_lowering_heads_in_the_wild_fuse(name):
    _assert_compiled_with_pass_matches_eager(WILD[name])
    assert counters["inductor"][lowering.FUSED] == 1, dict(counters[lowering.SKIPPED])


def _litgpt_chunked(m, h, y, n):
    # litgpt (utils.chunked_cross_entropy): the user chunks the logits themselves.
    logits, y = m.head(h).reshape(-1, V), y.reshape(-1)
    losses = [F.cross_entropy(a, b, reduction="none") for a, b in
              zip(logits.split(4), y.split(4))]
    return torch.cat(losses).sum() / (y != -100).sum()


WILD_UNFUSED = {
    # modded-nanogpt (2025-08 on): 30 * sigmoid(x / 7.5) is no tanh softcap: the op
    # cannot compute it, so the graph stays.
    "modded-nanogpt (sigmoid cap)": ((lambda m, h, y, n: F.cross_entropy(
        (30 * torch.sigmoid(m.padded(h).float() / 7.5)).view(-1, V + 11),
        y.view(-1).clamp_min(0))), "logits come from"),
    "litgpt chunked_cross_entropy": (_litgpt_chunked, "split"),
}


@pytest.mark.parametrize("name", WILD_UNFUSED)
def test_lowering_heads_in_the_wild_left_unfused_with_a_reason(name):
    fn, reason = WILD_UNFUSED[name]
    _assert_compiled_with_pass_matches_eager(fn)
    assert counters["inductor"][lowering.FUSED] == 0
    assert any(reason in why for why in counters[lowering.SKIPPED]), \
        dict(counters[lowering.SKIPPED])


class _NanoGPT(nn.Module):
    """nanoGPT's GPT.forward: returns (logits, loss), so the logits have another use."""

    def __init__(self):
        super().__init__()
        self.head = Head(None)

    def forward(self, x, y, n=None):
        logits = self.head.head(torch.tanh(self.head.proj(x)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        return logits, loss


def test_lowering_nanogpt_returning_logits_warns_and_matches_eager():
    model, (x, y, _) = _NanoGPT(), _inputs()
    y = y.masked_fill(y == -100, -1)
    ref = model(x, y)[1]
    with lowering.auto_fuse(), pytest.warns(lowering.UnfusedWarning, match="another use"):
        got = torch.compile(model, fullgraph=True)(x, y)[1]
    assert rel_err(got, ref) <= 1e-5 and counters["inductor"][lowering.FUSED] == 0


# float32 master weights cast to bf16 activations in the head (the op's master-weight
# path), as training code writes it: compared with eager at bf16 tolerance.
MASTER = {
    "w.to(x.dtype)+float+softcap": (lambda m, h, y, n: F.cross_entropy(
        (torch.tanh(F.linear(h.bfloat16(), m.head.weight.to(torch.bfloat16)).float() / 30.0)
         * 30.0).view(-1, V), y.view(-1))),
    "w.type_as(x), b.type_as(x)": (lambda m, h, y, n: F.cross_entropy(
        F.linear(h.bfloat16(), m.head.weight.type_as(h.bfloat16()),
                 m.head.bias.type_as(h.bfloat16())).float().view(-1, V), y.view(-1))),
    # Not from float32: the cast weight itself is the op's (bf16) weight.
    "fp16-then-bf16 cast chain": (lambda m, h, y, n: F.cross_entropy(
        F.linear(h.bfloat16(), m.head.weight.to(torch.float16).to(torch.bfloat16))
        .float().view(-1, V), y.view(-1))),
    "padded master head": (lambda m, h, y, n: F.cross_entropy(
        F.linear(h.bfloat16(), m.padded.weight.to(torch.bfloat16))[..., :V].float()
        .view(-1, V), y.view(-1))),
}


def _inputs(B=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 2] = -100
    return x.to(DEVICE), y.to(DEVICE), torch.tensor(float((y != -100).sum()), device=DEVICE)


def _loss_and_grads(model, fn, *args):
    model.zero_grad()
    loss = fn(*args)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                           if p.grad is not None}  # x @ W.T patterns leave the bias unused


def _assert_compiled_with_pass_matches_eager(loss_fn, dtype=torch.float32):
    model = Head(loss_fn)
    args = _inputs()
    ref_loss, ref_grads = _loss_and_grads(model, model, *args)
    with lowering.auto_fuse():
        loss, grads = _loss_and_grads(model, torch.compile(model, fullgraph=True), *args)
    assert rel_err(loss, ref_loss) <= (1e-5 if dtype == torch.float32 else 1e-3)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(dtype, 64), k


@pytest.mark.parametrize("name", MASTER)
def test_lowering_master_weight_cast_fuses_and_matches_eager(name):
    _assert_compiled_with_pass_matches_eager(MASTER[name], torch.bfloat16)
    assert counters["inductor"][lowering.FUSED] == 1, dict(counters[lowering.SKIPPED])


def test_lowering_warns_once_when_the_logits_have_another_use():
    with pytest.warns(lowering.UnfusedWarning, match="another use.*apply\\(model\\)") as seen:
        _assert_compiled_with_pass_matches_eager(_logits_reused)
    assert len([w for w in seen if issubclass(w.category, lowering.UnfusedWarning)]) == 1


@pytest.mark.parametrize("name", PATTERNS)
def test_lowering_pattern_fuses_and_matches_eager(name):
    _assert_compiled_with_pass_matches_eager(PATTERNS[name])
    assert counters["inductor"][lowering.FUSED] == 1, dict(counters[lowering.SKIPPED])


def _logits_reused(m, h, y, n):
    logits = m.head(h).view(-1, V)
    return F.cross_entropy(logits, y.view(-1)) + logits.mean()


def _z_loss(m, h, y, n):
    logits = m.head(h).view(-1, V)
    return F.cross_entropy(logits, y.view(-1)) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


NEGATIVE = {
    "logits reused": _logits_reused,
    # Not the first V rows: the op cannot take a strided or shifted block of the head.
    "vocab slice not from the start": (lambda m, h, y, n: F.cross_entropy(
        m.padded(h)[..., 11:].reshape(-1, V), y.reshape(-1))),

    "z-loss reuses the logits": _z_loss,
    "class dim not last": (lambda m, h, y, n: F.cross_entropy(m.head(h).transpose(1, 2), y)),
    # The slice indexes the flattened tokens, not hidden's (B, T): fusing would pair the
    # wrong rows.
    "slice of reshaped logits": (lambda m, h, y, n: F.cross_entropy(
        m.head(h).view(-1, V)[::2], y.view(-1)[::2])),
    "floor division is no softcap": (lambda m, h, y, n: F.cross_entropy(
        (torch.tanh(torch.div(m.head(h), 5.0, rounding_mode="floor")) * 5.0).view(-1, V),
        y.view(-1))),
    "probability targets": (lambda m, h, y, n: F.cross_entropy(
        m.head(h).view(-1, V), F.one_hot(y.clamp_min(0).view(-1), V).float())),
}


@pytest.mark.parametrize("name", NEGATIVE)
def test_lowering_leaves_other_uses_unfused(name):
    import warnings

    from torch_fce.lowering.patterns import OTHER_USE

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _assert_compiled_with_pass_matches_eager(NEGATIVE[name])
    # The pass says why where the reason costs the user memory (the logits' other use).
    unfused = [w for w in seen if issubclass(w.category, lowering.UnfusedWarning)]
    assert all(OTHER_USE in str(w.message) for w in unfused)
    assert counters["inductor"][lowering.FUSED] == 0
    assert sum(counters[lowering.SKIPPED].values()) >= 1


def test_lowering_skips_grad_mode_and_autocast_switches():
    # The fused op would run where the cross entropy ran: in a different grad mode or
    # autocast state than the linear.
    w = torch.randn(V, D, device=DEVICE, requires_grad=True)
    y = torch.randint(0, V, (12,), device=DEVICE)

    def no_grad_linear(h):
        with torch.no_grad():
            logits = F.linear(h, w)
        return F.cross_entropy(logits, y)

    def autocast_linear(h):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = F.linear(h, w)
        return F.cross_entropy(logits.float(), y)

    h = torch.randn(12, D, device=DEVICE)
    for fn in (no_grad_linear, autocast_linear):
        with lowering.auto_fuse():
            torch.compile(fn, fullgraph=True)(h)
    assert counters["inductor"][lowering.FUSED] == 0
    assert counters[lowering.SKIPPED][
        "grad mode or autocast changes between linear and cross_entropy"] == 2


def test_lowering_keeps_a_bf16_loss_bf16():
    h = torch.randn(12, D, device=DEVICE).bfloat16()
    w = torch.randn(V, D, device=DEVICE).bfloat16()
    y = torch.randint(0, V, (12,), device=DEVICE)

    def fn(h, w):
        return F.cross_entropy(F.linear(h, w), y)

    with lowering.auto_fuse():
        loss = torch.compile(fn, fullgraph=True)(h, w)
    assert counters["inductor"][lowering.FUSED] == 1
    assert loss.dtype == torch.bfloat16 and rel_err(loss, fn(h, w)) <= 2 ** -7


def test_lowering_auto_fuse_warns_when_nothing_compiled_inside():
    # torch.compile is lazy: made inside the block, first called after it, it runs
    # unfused; the block says so instead of fusing nothing silently.
    model, args = Head(PATTERNS["hf_causal_lm"]), _inputs()
    with pytest.warns(UserWarning, match="nothing was compiled inside the block"):
        with lowering.auto_fuse():
            step = torch.compile(model, fullgraph=True)
    step(*args)
    assert counters["inductor"][lowering.FUSED] == 0
    torch._dynamo.reset()  # else the unfused compile above is reused (and warned about)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with lowering.auto_fuse():
            torch.compile(model, fullgraph=True)(*_inputs(seed=1))
    assert counters["inductor"][lowering.FUSED] == 1


def test_lowering_auto_fuse_restores_the_accumulator():
    lowering.enable("kahan")
    try:
        with pytest.warns(UserWarning, match="nothing was compiled"), lowering.auto_fuse():
            pass
        assert lowering._PASS.accumulator == "kahan"
        with pytest.raises(ValueError, match="accumulator"):
            lowering.enable("bf16")
    finally:
        lowering.disable()
        lowering._PASS.accumulator = "fp32"


def test_lowering_inference_and_dynamic_shapes():
    model = Head(PATTERNS["hf_causal_lm"])
    with lowering.auto_fuse():
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            for T in (5, 7, 9, 12):
                x, y, n = _inputs(T=T, seed=T)
                assert rel_err(compiled(x, y, n), model(x, y, n)) <= 1e-5
    # one static compile, then one dynamic graph for every later length
    assert counters["inductor"][lowering.FUSED] == 2
    assert counters["stats"]["unique_graphs"] == 2


def test_lowering_other_backends_run_unfused():
    model = Head(PATTERNS["hf_causal_lm"])
    args = _inputs()
    with lowering.auto_fuse():
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(*args)
    assert counters["inductor"][lowering.FUSED] == 0
    assert rel_err(out, model(*args)) <= 1e-6


def test_lowering_chains_with_an_installed_pass():
    seen = []

    class Other(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen.append(True)

        def uuid(self):
            return "other"

    other = Other()
    with torch._inductor.config.patch(pre_grad_custom_pass=other):
        lowering.enable()
        # one callable, as Inductor takes it on every torch version
        assert isinstance(torch._inductor.config.pre_grad_custom_pass, lowering.Chain)
        assert lowering.installed() == (other, lowering._PASS)
        torch.compile(Head(PATTERNS["slice_shift"]))(*_inputs())
        lowering.disable()
        assert torch._inductor.config.pre_grad_custom_pass is other
    assert seen and counters["inductor"][lowering.FUSED] == 1


def test_lowering_chain_is_cached_only_when_every_pass_names_its_version():
    class Versioned(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __init__(self, key):
            self.key = key

        def __call__(self, graph):
            pass

        def uuid(self):
            return self.key

    assert lowering.Chain((Versioned("a"), lowering._PASS)).uuid() is not None
    # a pass that opts out of caching (uuid None) or is a plain function keeps the chain
    # out of Inductor's caches, instead of keying it on "None" or an address
    for other in (Versioned(None), lambda graph: None):
        assert lowering.Chain((other, lowering._PASS)).uuid() is None


class TestFusedGraph(expecttest.TestCase):
    def _pre_grad_ops(self, name):
        graphs = []

        class Capture(torch._inductor.custom_graph_pass.CustomGraphPass):
            def __call__(self, graph):
                graphs.append(collections.Counter(
                    _op_name(n) for n in graph.nodes if n.op in ("call_function", "call_method")))

            def uuid(self):
                return "capture"

        torch._dynamo.reset()
        with lowering.auto_fuse():
            chain = lowering.Chain(lowering.installed() + (Capture(),))
            with torch._inductor.config.patch(pre_grad_custom_pass=chain):
                torch.compile(Head(PATTERNS[name]), fullgraph=True)(*_inputs())
        return " ".join(f"{k}x{v}" for k, v in sorted(graphs[0].items()))

    def test_lowering_hf_graph_has_fused_op_and_no_logits(self):
        # The lm head's linear and cross_entropy are gone; the labels' pad/shift stay.
        self.assertExpectedInline(self._pre_grad_ops("hf_causal_lm"), """contiguousx1 flattenx1 getitemx1 linearx1 linear_ce.defaultx1 padx1 reshapex1 tanhx1 truedivx1 viewx1""")

    def test_lowering_padded_vocab_graph_slices_the_weight(self):
        self.assertExpectedInline(self._pre_grad_ops("padded_vocab_slice+shift"), """flattenx1 getitemx4 linearx1 linear_ce.defaultx1 reshapex2 tanhx1""")

    def test_lowering_softcap_graph(self):
        self.assertExpectedInline(self._pre_grad_ops("gemma_softcap"), """flattenx1 linearx1 linear_ce.defaultx1 reshapex1 tanhx1 viewx1""")


def _op_name(node):
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


@pytest.mark.parametrize("tied", [False, True])
def test_lowering_tiny_lm_trains_like_unfused(tied):
    from torch_fce.bench.tiny_lm import TinyLM

    def train(fuse):
        torch.manual_seed(0)
        model = TinyLM(97, dim=32, layers=1, heads=2, max_len=16, tied=tied).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = torch.compile(model, fullgraph=True)
        g = torch.Generator().manual_seed(1)
        losses = []
        with lowering.auto_fuse() if fuse else contextlib.nullcontext():
            for _ in range(5):
                ids = torch.randint(0, 97, (2, 16), generator=g).to(DEVICE)
                loss = step(ids, ids)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    losses, params = train(fuse=True)
    assert counters["inductor"][lowering.FUSED] >= 1
    torch._dynamo.reset()
    ref_losses, ref_params = train(fuse=False)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for p, q in zip(params, ref_params):
        assert rel_err(p, q) <= 1e-5

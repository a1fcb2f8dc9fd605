"""torch_fce.integrations.verl: verl's fused-kernel call (linear_cross_entropy(hidden,
weight, labels, temperature, reduction, dist_process_group) -> (logprobs, entropy))
against a float64 composition written as verl's own kernel test writes it, at odd V
(verl's kernel is reported wrong when V is not a multiple of 256), every reduction, any
upstream gradients; apply() and revert() on verl's module (a stand-in here: verl's
package does not import without its training stack). The tensor-parallel group runs in
tests/distributed."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from torch_fce.integrations import verl as fce_verl
from torch_fce.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _verl_reference(hidden, weight, labels, temperature, reduction):
    """verl's tests/utils/test_linear_cross_entropy.py reference, in float64."""
    logits = (hidden @ weight.T) / temperature
    pd = logits.softmax(-1)
    entropy = torch.logsumexp(logits, -1) - (pd * logits).sum(-1)
    logprobs = -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction=reduction)
    return (logprobs.view(labels.shape) if reduction == "none" else logprobs), entropy


@pytest.mark.parametrize("V", [31, 257, 1000])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape", [(13,), (2, 7)])
def test_verl_call_equals_verls_reference_at_odd_v(V, reduction, shape):
    g = torch.Generator().manual_seed(V)
    D = 16
    h64 = torch.randn(*shape, D, generator=g, dtype=torch.float64) * 2
    w64 = torch.randn(V, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, shape, generator=g)
    labels.view(-1)[1] = -100
    ge = torch.randn(shape, generator=g, dtype=torch.float64)
    gl = torch.randn(shape if reduction == "none" else (), generator=g, dtype=torch.float64)
    results = []
    for fn, dtype in ((fce_verl.linear_cross_entropy, torch.float32),
                      (_verl_reference, torch.float64)):
        h = h64.to(DEVICE, dtype).requires_grad_()
        w = w64.to(DEVICE, dtype).requires_grad_()
        lp, ent = fn(h, w, labels.to(DEVICE), 0.7, reduction)
        grads = torch.autograd.grad((lp * gl.to(lp)).sum() + (ent * ge.to(ent)).sum(), (h, w))
        results.append((lp, ent, *grads))
    for got, want in zip(*results):
        assert got.shape == want.shape
        assert rel_err(got.double(), want) <= 2e-5


def test_verl_megatron_layout_hidden_sbh_labels_1s():
    # verl's Megatron callers pass hidden (s, 1, D) with packed labels (1, s): paired
    # once flattened, returned flat as verl's kernel returns them.
    g = torch.Generator().manual_seed(1)
    h = torch.randn(10, 1, 16, generator=g, dtype=torch.float64)
    w = torch.randn(257, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 257, (1, 10), generator=g)
    lp, ent = fce_verl.linear_cross_entropy(h, w, y, 0.7)
    want = _verl_reference(h.reshape(10, 16), w, y.reshape(10), 0.7, "none")
    assert lp.shape == ent.shape == (10,)
    assert rel_err(lp, want[0]) <= 1e-12 and rel_err(ent, want[1]) <= 1e-12
    with pytest.raises(ValueError, match="labels"):
        fce_verl.linear_cross_entropy(h, w, y[:, :9], 0.7)


def test_verl_float64_is_exact_and_bad_reduction_is_named():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64)
    w = torch.randn(300, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 300, (5,), generator=g)
    got = fce_verl.linear_cross_entropy(h, w, y, 1.3)
    want = _verl_reference(h, w, y, 1.3, "none")
    assert rel_err(got[0], want[0]) <= 1e-12 and rel_err(got[1], want[1]) <= 1e-12
    with pytest.raises(ValueError, match="reduction"):
        fce_verl.linear_cross_entropy(h, w, y, 1.0, "avg")


def test_verl_apply_swaps_the_entry_point_and_revert_puts_it_back(monkeypatch):
    theirs = object()
    module = types.ModuleType("verl.utils.kernel.linear_cross_entropy")
    module.linear_cross_entropy = theirs
    monkeypatch.setitem(sys.modules, "verl.utils.kernel.linear_cross_entropy", module)
    with pytest.raises(ValueError, match="accumulator"):
        fce_verl.apply(accumulator="bf16")
    fce_verl.apply()
    with pytest.raises(ValueError, match="already applied"):
        fce_verl.apply()
    # as verl's HF forward calls it: looked up on the module, positional arguments
    h, w = torch.randn(2, 3, 8), torch.randn(31, 8)
    y = torch.randint(0, 31, (2, 3))
    lp, ent = module.linear_cross_entropy(h, w, y, 0.7, "none")
    want = fce_verl.linear_cross_entropy(h, w, y, 0.7)
    assert torch.equal(lp, want[0]) and torch.equal(ent, want[1])
    fce_verl.revert()
    assert module.linear_cross_entropy is theirs and vars(module).keys() == {
        "__name__", "__doc__", "__package__", "__loader__", "__spec__", "linear_cross_entropy"}
    with pytest.raises(ValueError, match="not applied"):
        fce_verl.revert()


def test_verl_kernel_test_regime_bf16_within_verls_tolerance():
    # verl's own kernel test: bf16 hidden (1, 16, 896) and weight (151936, 896) uniform in
    # [-0.5, 0.5), temperature 1.5, against its reference from the same bf16 values with
    # float32 logits, at its tolerance (1e-3 absolute + 2e-4 relative). Logits rounded
    # to bf16 put 2 of 16 log-probs outside it (4.7e-3 off); the adapter keeps float32
    # logits, as verl's kernel does.
    g = torch.Generator().manual_seed(0)
    h = (torch.rand(1, 16, 896, generator=g) - 0.5).to(DEVICE, torch.bfloat16)
    w = (torch.rand(151936, 896, generator=g) - 0.5).to(DEVICE, torch.bfloat16)
    labels = torch.randint(0, 151936, (1, 16), generator=g).to(DEVICE)
    lp, ent = fce_verl.linear_cross_entropy(h, w, labels, 1.5)
    want_lp, want_ent = _verl_reference(h.double(), w.double(), labels, 1.5, "none")
    for got, want in ((lp, want_lp), (ent, want_ent)):
        torch.testing.assert_close(got.double(), want.reshape(got.shape), atol=1e-3,
                                   rtol=2e-4)

"""torch.compile(fullgraph=True): equality with eager, dynamic shapes, captured graphs."""

import expecttest
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import torch_fce
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import grad_tol

# The GPU tier runs this module on CUDA (README); CI on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

OPTIONS = {
    "mean_all_options": dict(reduction="mean", label_smoothing=0.1, softcap=20.0, z_loss=1e-3),
    "none": dict(reduction="none"),
}


def _loss_and_grads(fn, x, options):
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    loss = fn(leaves["hidden"], leaves["weight"], x["target"], leaves["bias"],
              x["class_weight"], options)
    loss.sum().backward()
    return loss, {k: v.grad for k, v in leaves.items()}


def _eager(h, w, t, b, cw, options):
    return torch_fce.linear_cross_entropy(h, w, t, b, cw, **options)


_compiled = torch.compile(_eager, fullgraph=True, dynamic=True)


def _ce_option(h, w, t, name, value):
    return torch_fce.linear_cross_entropy(h, w, t, **{name: value})


def _logprobs_option(h, w, t, name, value):
    return torch_fce.linear_logprobs(h, w, t, **{name: value}).logprob


_BAD_OPTIONS = {
    _ce_option: [("label_smoothing", 1.5, 0.1), ("softcap", -1.0, 2.0), ("z_loss", -1.0, 0.1),
                 ("reduction", "avg", "sum"), ("accumulator", "bf16", "input"),
                 ("ignore_index", 1.5, -100)],
    # A temperature that is not > 0: the CPU kernel's check (on CUDA, NaN outputs unless
    # TORCH_FCE_CHECK_TARGETS=1, as for a temperature tensor: docs/api.md).
    _logprobs_option: [("softcap", -1.0, 2.0), ("temperature", -1.0, 0.7),
                       ("accumulator", "bf16", "kahan"), ("entropy", "yes", True)],
}


@pytest.mark.parametrize("fn,option,bad,good", [
    (fn, *case) for fn, cases in _BAD_OPTIONS.items() for case in cases
    if not (case[0] == "temperature" and torch.cuda.is_available())])
def test_compiled_fullgraph_dynamic_bad_option_names_it(fn, option, bad, good):
    # fullgraph=True, dynamic=True: floats are symbolic, yet the error still names the
    # option, whether the bad value comes first or after a good one (a recompile). The
    # ops' fake kernels check them (types: the dispatcher, naming the argument): an
    # error raised before the op would reach the caller as Dynamo's "Observed exception".
    # (torch 2.13 appends the message to "Observed exception" as debug context; 2.11
    # does not.)
    x = make_inputs(6, 4, 5, device=DEVICE)
    step = torch.compile(fn, fullgraph=True, dynamic=True)
    step(x["hidden"], x["weight"], x["target"], option, good)
    for compiled in (step, torch.compile(fn, fullgraph=True, dynamic=True)):
        with pytest.raises((ValueError, TypeError, RuntimeError),
                           match=rf"{option} must|argument \W*{option}") as error:
            compiled(x["hidden"], x["weight"], x["target"], option, bad)
        assert "Observed exception" not in str(error.value)


@pytest.mark.parametrize("name", OPTIONS)
def test_linear_ce_compiled_matches_eager(name):
    x = make_inputs(24, 8, 37, bias=True, class_weight=True, device=DEVICE)
    x["hidden"] = x["hidden"].reshape(2, 12, 8)
    x["target"] = x["target"].reshape(2, 12)
    loss, grads = _loss_and_grads(_compiled, x, OPTIONS[name])
    ref_loss, ref_grads = _loss_and_grads(_eager, x, OPTIONS[name])
    assert rel_err(loss, ref_loss) <= 1e-6
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(torch.float32, 37), k


def test_linear_ce_dynamic_batch_no_recompile_storm():
    def fresh(h, w, t, b, cw, options):  # its own code object: no dynamism learnt elsewhere
        return torch_fce.linear_cross_entropy(h, w, t, b, cw, **options)

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(fresh, fullgraph=True, backend=counter)
    for n in (5, 7, 9, 16, 31):
        x = make_inputs(n, 8, 37, device=DEVICE)
        _loss_and_grads(fn, {**x, "bias": torch.zeros(37, device=DEVICE)}, {})
    assert counter.frame_count == 2  # one static compile, then one dynamic graph for all N


class TestCapturedGraph(expecttest.TestCase):
    def _op_sets(self, options, dtype):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        fn = torch.compile(_eager, fullgraph=True, dynamic=True,
                           backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
        _loss_and_grads(fn, make_inputs(6, 4, 9, dtype, bias=True, device=DEVICE), options)
        return "\n".join(
            " ".join(sorted({str(n.target).replace("<built-in function getitem>", "getitem")
                             for n in g.graph.nodes if n.op == "call_function"}))
            for g in graphs)

    def test_linear_ce_graph_has_no_logits(self):
        # Forward then backward graph: the fused op and views; no mm/softmax/log_softmax.
        self.assertExpectedInline(self._op_sets({}, torch.float32), """\
aten.view.default fce.linear_ce_fwd.default getitem
aten.view.default fce.scale_grad.default""")

    def test_linear_ce_graph_bf16_casts_grads_once(self):
        self.assertExpectedInline(self._op_sets({}, torch.bfloat16), """\
aten.view.default fce.linear_ce_fwd.default getitem
aten.view.default fce.scale_grad.default""")

    def test_linear_ce_graph_per_token_loss_recomputes_in_backward(self):
        self.assertExpectedInline(self._op_sets(dict(reduction="none"), torch.float32), """\
aten.view.default fce.linear_ce_fwd.default getitem
aten.view.default fce.linear_ce_bwd.default getitem""")

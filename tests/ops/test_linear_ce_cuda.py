"""The CUDA backend at real sizes: reference agreement, CUDA graphs, compile, 64-bit
indexing, untouched inputs. Skipped without a GPU."""

import pytest
import torch

import torch_fce
from torch_fce.ops.linear_policy_loss import LOSS_TYPES
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import (
    LOSS_TOL, capture_cuda_graph, grad_tol, no_host_sync, reference_loss_and_grads)

pytestmark = pytest.mark.cuda

OPTION_SETS = [
    dict(reduction="mean"),
    dict(reduction="sum", label_smoothing=0.1, softcap=30.0, z_loss=1e-4),
    dict(reduction="none", ignore_index=5),
]


def _op(x, options, accumulator="fp32", grad_out=None):
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")
              if x[k] is not None}
    loss = torch_fce.linear_cross_entropy(**{**x, **leaves}, **options,
                                          accumulator=accumulator)
    loss.backward(grad_out if grad_out is not None else torch.ones_like(loss))
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("accumulator", ["fp32", "kahan", "input"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_reference(options, accumulator, dtype):
    x = make_inputs(3000, 256, 50257, dtype, bias=options["reduction"] == "sum",
                    class_weight=options["reduction"] == "sum", device="cuda",
                    weight_scale=2.0)
    if options.get("ignore_index") == 5:
        x["target"][x["target"] == -100] = 5
    g = torch.randn(3000, device="cuda") if options["reduction"] == "none" else None
    if dtype == torch.float16 and options["reduction"] == "mean":
        # As under GradScaler: unscaled fp16 gradients of a mean underflow (in torch too).
        g = torch.tensor(2.0 ** 16, device="cuda")
    loss, grads = _op(x, options, accumulator, g)
    ref_loss, ref = reference_loss_and_grads(**x, grad_out=g, **options)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    tol = grad_tol(dtype, 50257) * (4 if accumulator == "input" else 1)
    for k, v in grads.items():
        assert v.dtype == x[k].dtype
        assert rel_err(v, ref[k]) <= tol, k


def test_cuda_master_weights():
    x = make_inputs(2048, 128, 32000, torch.bfloat16, weight_dtype=torch.float32,
                    device="cuda")
    loss, grads = _op(x, {})
    ref_loss, ref = reference_loss_and_grads(**x)
    assert grads["weight"].dtype == torch.float32
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    # The logits gradient is rounded to bf16 before the GEMM (products in hidden's dtype).
    assert rel_err(grads["weight"], ref["weight"]) <= grad_tol(torch.bfloat16, 2048)


def test_cuda_graph_capture_forward_backward():
    x = make_inputs(1024, 128, 32000, torch.bfloat16, device="cuda")
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    t = x["target"].clone()

    def step():
        h.grad = w.grad = None
        loss = torch_fce.linear_cross_entropy(h, w, t, z_loss=1e-4)
        loss.backward()
        return loss

    graph, static_loss = capture_cuda_graph(step)
    y = make_inputs(1024, 128, 32000, torch.bfloat16, device="cuda", seed=1)
    with torch.no_grad():
        h.copy_(y["hidden"])
        t.copy_(y["target"])
    graph.replay()
    torch.cuda.synchronize()
    y["weight"] = x["weight"]
    ref_loss, ref = reference_loss_and_grads(**y, z_loss=1e-4)
    assert rel_err(static_loss, ref_loss) <= LOSS_TOL
    assert rel_err(h.grad, ref["hidden"]) <= grad_tol(torch.bfloat16, 32000)


def _every_entry(h, w, t, b):
    """One step through every entry: the loss with stats, per-token losses, the module,
    the log-probs with entropy at a temperature, the policy loss, the distillation and
    the sparse-target cross entropy, each with a gradient."""
    loss, stats = torch_fce.linear_cross_entropy(h, w, t, b, return_stats=True, z_loss=1e-4,
                                                 label_smoothing=0.1, softcap=30.0)
    per_token = torch_fce.linear_cross_entropy(h, w, t, b, reduction="none")
    module = torch_fce.LinearCrossEntropyLoss(shift=True)(h[None], w, t[None], b)
    lp = torch_fce.linear_logprobs(h, w, t, b, temperature=0.7, entropy=True, softcap=30.0)
    old = lp.logprob.detach() - 0.1
    policy = sum(torch_fce.linear_policy_loss(
        h, w, t, torch.ones_like(old), b, old_logprobs=old, ref_logprobs=old, beta=0.04,
        entropy_coef=0.01, temperature=0.7, loss_type=loss_type, epsilon_high=1.5)[0]
        for loss_type in LOSS_TYPES)
    # the distillation (a teacher made from the inputs, without gradient) at each beta,
    # and the sparse-target cross entropy to a top-4
    ht, wt = torch.sin(h.detach() * 1.3), torch.cos(w.detach() * 0.7)
    distill = sum(torch_fce.linear_distillation_loss(
        h, w, ht, wt, t, b, beta=beta, hard_weight=0.1, temperature=0.9)[0]
        for beta in (0.0, 0.5, 1.0))
    idx = (t.clamp(min=0)[:, None] + torch.arange(4, device=t.device)) % w.shape[0]
    probs = torch.softmax(torch.arange(4.0, device=t.device).expand(t.shape[0], 4), -1)
    soft = torch_fce.linear_soft_cross_entropy(h, w, idx, probs, b, temperature=0.8)
    # a teacher's top-8 (no gradient; from the inputs, not from values the compiled
    # graph recomputes, whose rounding may differ) and the sparse divergence over it
    top = torch_fce.linear_topk_logprobs(h.detach().flip(0), w.detach(), 8, target=t,
                                         temperature=0.8)
    sparse = sum(torch_fce.linear_sparse_divergence(
        h, w, top.indices, top.logprobs, b, beta=beta, tail=tail, temperature=0.8)[0]
        for beta, tail in ((0.0, True), (0.5, False)))
    total = loss + per_token.mean() + module + lp.logprob.mean() + lp.entropy.mean() + \
        policy + distill + soft + sparse
    return total, torch.stack([stats.lse.sum(), stats.argmax.sum().float(),
                               stats.entropy.sum(), top.indices.sum().float(),
                               top.logprobs.sum(), top.target_logprob.sum()])


@pytest.mark.parametrize("how", ["cuda_graph", "compiled_fullgraph_dynamic"])
def test_cuda_every_op_captured_and_compiled(how):
    # CUDA-graph capture and fullgraph dynamic compile of every op, against eager.
    x = make_inputs(512, 64, 4099, torch.bfloat16, device="cuda", bias=True)
    leaves = [x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    t = x["target"].clone()

    def step(fn):
        for p in leaves:
            p.grad = None
        total, stats = fn(*leaves[:2], t, leaves[2])
        total.backward()
        return torch.cat([total.detach()[None], stats])

    want = step(_every_entry)
    want_grads = [p.grad.clone() for p in leaves]
    if how == "cuda_graph":
        graph, got = capture_cuda_graph(lambda: step(_every_entry))
        graph.replay()
        torch.cuda.synchronize()
    else:
        got = step(torch.compile(_every_entry, fullgraph=True, dynamic=True))
    # the same kernels; the compiled composition may round the upstream gradients of
    # the sums differently, and autograd adds the entries' bf16 gradients (a dozen) in
    # another order: a bf16 gradient then differs in its last bits (measured 4.2e-3 on
    # the H200 with the distillation and soft CE in the step)
    assert rel_err(got, want) <= 1e-6
    for p, g in zip(leaves, want_grads):
        assert rel_err(p.grad, g) <= 2 ** -7


def test_cuda_compile_matches_eager():
    x = make_inputs(2048, 128, 32000, torch.bfloat16, device="cuda")
    compiled = torch.compile(torch_fce.linear_cross_entropy, fullgraph=True)
    h1, h2 = (x["hidden"].clone().requires_grad_() for _ in range(2))
    l1 = compiled(h1, x["weight"], x["target"], z_loss=1e-4)
    l1.backward()
    l2 = torch_fce.linear_cross_entropy(h2, x["weight"], x["target"], z_loss=1e-4)
    l2.backward()
    assert rel_err(l1, l2) <= 1e-6 and rel_err(h1.grad, h2.grad) <= 1e-6


def test_cuda_more_than_2_31_logits():
    N, D, V = 16500, 16, 131072  # N * V = 2.16e9 > 2^31
    x = make_inputs(N, D, V, torch.bfloat16, device="cuda", ignore_frac=0.1)
    loss, grads = _op(x, dict(reduction="sum"))
    ref_loss, ref_w = 0.0, torch.zeros(V, D, dtype=torch.float64, device="cuda")
    for s in range(0, N, 2048):  # the reference, chunked so its logits fit
        part = {**x, "hidden": x["hidden"][s:s + 2048], "target": x["target"][s:s + 2048]}
        l, g = reference_loss_and_grads(**part, reduction="sum")
        ref_loss += l
        ref_w += g["weight"]
        assert rel_err(grads["hidden"][s:s + 2048], g["hidden"]) <= grad_tol(torch.bfloat16, V)
    assert rel_err(loss, ref_loss) <= LOSS_TOL
    assert rel_err(grads["weight"], ref_w) <= grad_tol(torch.bfloat16, N)


def test_cuda_inputs_unchanged_and_bad_target_is_nan():
    # The op gets the caller's own tensors (no defensive copies in the test), on both
    # gradient paths: in the forward (mean) and recomputed in the backward (none).
    x = make_inputs(512, 64, 5000, torch.bfloat16, bias=True, class_weight=True,
                    device="cuda")
    x["target"][7] = 5000  # out of range: NaN, never an out-of-bounds read
    for k in ("hidden", "weight", "bias"):
        x[k].requires_grad_()
    before = {k: v.detach().clone() for k, v in x.items() if v is not None}
    ptrs = {v.data_ptr() for v in x.values() if v is not None}
    for reduction in ("mean", "none"):
        for accumulator in ("fp32", "kahan", "input"):
            loss = torch_fce.linear_cross_entropy(**x, reduction=reduction,
                                                  accumulator=accumulator)
            loss.backward(torch.ones_like(loss))
            outputs = [loss] + [x[k].grad for k in ("hidden", "weight", "bias")]
            assert not {t.data_ptr() for t in outputs} & ptrs
            for k in ("hidden", "weight", "bias"):
                x[k].grad = None
    assert torch.isnan(loss[7]) and torch.isfinite(loss[:7]).all()
    for k, v in before.items():
        assert torch.equal(x[k], v), k


@pytest.mark.parametrize("accumulator", ["fp32", "kahan", "input"])
def test_cuda_no_host_sync(accumulator):
    # torch raises on any synchronising CUDA call in this mode (.item(), nonzero, ...).
    x = make_inputs(256, 64, 3000, torch.bfloat16, bias=True, class_weight=True,
                    device="cuda")
    ups = [torch.ones((), device="cuda"), torch.ones(256, device="cuda")]
    with no_host_sync():
        for options in OPTION_SETS:
            g = ups[options["reduction"] == "none"]
            _op(x, options, accumulator, grad_out=g)
        _op({**x, "weight": x["weight"].float()}, OPTION_SETS[1], accumulator,
            grad_out=ups[0])  # master weights


def test_cuda_opt_in_target_check_raises(monkeypatch):
    from torch_fce.ops.contract import checks

    monkeypatch.setattr(checks, "CHECK_TARGETS", True)
    x = make_inputs(64, 16, 100, torch.bfloat16, device="cuda")
    x["target"][3] = 100
    with pytest.raises(IndexError, match="target"):
        torch_fce.linear_cross_entropy(**x)


def _peak_beyond_inputs(N, D, V, **options):
    """Peak bytes allocated by a bf16 forward + backward beyond its inputs, and the
    backend's logits chunk in bytes."""
    from torch_fce.ops.loop.workspace import chunk_rows

    x = make_inputs(N, D, V, torch.bfloat16, device="cuda")
    h, w = x["hidden"].requires_grad_(), x["weight"].requires_grad_()
    # A first run outside the measurement: cuBLAS allocates its workspace once per
    # process, which would otherwise count when this test runs first.
    torch_fce.linear_cross_entropy(h, w, x["target"], **options).backward()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch_fce.linear_cross_entropy(h, w, x["target"], **options).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, chunk_rows(N, V, D, torch.bfloat16, "cuda") * V * 2


def test_cuda_memory_is_one_chunk_plus_the_sums():
    # Peak beyond inputs: the float32 weight-gradient sum, one logits chunk (4096 rows:
    # the default's floor for a head this small, an eighth of the logits here), the
    # hidden gradient's sum and the bf16 gradients of the backward.
    N, D, V = 32768, 256, 65536
    peak, chunk = _peak_beyond_inputs(N, D, V)
    assert chunk == 4096 * V * 2
    budget = chunk + V * D * (4 + 2) + N * D * 2 * 2
    assert peak <= budget + (8 << 20)


def test_cuda_kahan_memory_is_the_two_sums_plus_one_chunk():
    # Weight-sized buffers dominate here (V*D*2 = 64 MiB, chunk 16 MiB): the peak is the
    # bf16 sum and its compensation plus one chunk, never a third weight-sized buffer.
    N, D, V = 1024, 1024, 32768
    peak, chunk = _peak_beyond_inputs(N, D, V, accumulator="kahan")
    budget = chunk + V * D * 2 * 2 + N * D * 2 * 2
    assert peak <= budget + (8 << 20)


def test_cuda_float64_gradients_are_float64_exact():
    # float64 on the GPU keeps float64 precision through the backward's scaling of the
    # forward's gradients (a float32 multiply there once cost 2.5e-8): the loss and the
    # policy loss, a non-unit upstream gradient, against the float64 composition.
    x = make_inputs(300, 32, 1001, torch.float64, bias=True, device="cuda", weight_scale=2.0)
    g = torch.tensor(0.37, dtype=torch.float64, device="cuda")
    loss, grads = _op(x, dict(reduction="sum"), grad_out=g)
    ref_loss, ref = reference_loss_and_grads(**x, grad_out=g, reduction="sum")
    assert rel_err(loss, ref_loss) <= 1e-12
    for k, v in grads.items():
        assert rel_err(v, ref[k]) <= 1e-12, k

    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    A = torch.linspace(-1, 1, 300, dtype=torch.float64, device="cuda")
    loss, _ = torch_fce.linear_policy_loss(leaves["hidden"], leaves["weight"], x["target"], A,
                                           leaves["bias"], loss_type="reinforce")
    got = torch.autograd.grad(loss * g, list(leaves.values()))
    h, w, b = (x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    valid = x["target"] != -100
    logp = torch.nn.functional.linear(h, w, b).log_softmax(-1)
    lp_ref = logp.gather(-1, x["target"].clamp_min(0)[:, None]).squeeze(-1)
    ratio = torch.exp(lp_ref - lp_ref.detach())  # 1, with the gradient of the log-prob
    ref_policy = torch.where(valid, -A * ratio, 0.0).sum() / valid.sum()
    want = torch.autograd.grad(ref_policy * g, (h, w, b))
    assert rel_err(loss, ref_policy) <= 1e-12
    for a, r in zip(got, want):
        assert rel_err(a, r) <= 1e-12


@pytest.mark.parametrize("op", ["logprobs", "policy"])
def test_cuda_log_prob_family_peak_within_a_float32_weight_sum_and_a_tile(op):
    # A Qwen2.5-0.5B head (bf16, 16384 tokens): the default's peak beyond inputs and
    # gradients within a float32 weight-gradient sum plus 256 MiB (what a vocabulary-
    # tiled head, TRL's, holds) and the per-token vectors; the cross-entropy's default
    # chunk took 1262 MiB here.
    N, D, V = 16384, 896, 151936
    x = make_inputs(N, D, V, torch.bfloat16, device="cuda")
    h, w, t = x["hidden"].requires_grad_(), x["weight"].requires_grad_(), x["target"]
    a = torch.randn(N, device="cuda")

    def run():
        if op == "logprobs":
            out = torch_fce.linear_logprobs(h, w, t, temperature=0.7, entropy=True)
            (out.logprob.sum() + out.entropy.sum()).backward()
        else:
            torch_fce.linear_policy_loss(h, w, t, a, beta=0.04, ref_logprobs=a.detach() - 3,
                                         temperature=0.7)[0].backward()
    run()  # cuBLAS's workspace, outside the measurement
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - (N + V) * D * 2  # less the gradients
    assert peak <= 4 * V * D + (256 << 20) + 64 * N * 4, peak / 2**20

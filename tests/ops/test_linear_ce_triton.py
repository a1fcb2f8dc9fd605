"""The Triton row kernel inside the chunked loop, against the float64 reference.

Without a GPU this runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

import pytest
import torch
from hypothesis import given, strategies as st

from torch_fce.ops import linear_ce
from torch_fce.ops.linear_ce import CEOptions
from torch_fce.ops.linear_ce.rows import torch_ce_stats, torch_shard_grad, torch_shard_stats
from torch_fce.ops.linear_ce.kernels import triton_shard_grad, triton_shard_stats
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import (
    EPS, LOSS_TOL, allowed_error, grad_tol, reference_loss_and_grads, torch_loss_and_grads)

from tests.helpers import ONE_DEVICE, TRITON, chunks
from tests.helpers import ce_problems as problems

# Compiled kernels on a GPU machine, the interpreter on CPU tensors elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _to_device(x):
    return {k: None if v is None else v.to(DEVICE) for k, v in x.items()}


def _triton_loss_and_grads(x, options, accumulator, chunk_rows, grad_out):
    h = x["hidden"].reshape(-1, x["hidden"].shape[-1])
    t = x["target"].reshape(-1)
    args = (h, x["weight"], t, x["bias"], x["class_weight"])
    opts = CEOptions(-100, options["reduction"], options["label_smoothing"],
                     options["softcap"], options["z_loss"], accumulator)
    needs = [True, True, x["bias"] is not None]
    with chunks(chunk_rows, h, x["weight"]):
        if options["reduction"] == "none":
            loss = linear_ce.fwd(*args, *opts, *ONE_DEVICE, [False] * 3, False,
                                 backend=TRITON)[0]
            grads = linear_ce.bwd(grad_out.reshape(-1), *args, *opts, *ONE_DEVICE, needs,
                                  backend=TRITON)
        else:
            loss, *grads, _, _ = linear_ce.fwd(*args, *opts, *ONE_DEVICE, needs, False,
                                               backend=TRITON)
            grads = [g * grad_out for g in grads]
    grads = [grads[0].reshape(x["hidden"].shape), *grads[1:]]
    return loss, dict(zip(("hidden", "weight", "bias"), grads))


@given(problems(dtypes=(torch.float32, torch.float16, torch.bfloat16), vocab=(2, 31, 97)),
       st.sampled_from(["fp32", "kahan", "input"]), st.sampled_from([1, 5, 64]),
       st.integers(0, 2**16))
def test_triton_rows_match_reference(problem, accumulator, chunk_rows, seed):
    x, options = problem
    x = _to_device(x)
    N = x["target"].numel()
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(N, generator=gen) if options["reduction"] == "none" else torch.tensor(1.7)
    g = g.to(DEVICE)
    loss, grads = _triton_loss_and_grads(x, options, accumulator, chunk_rows, g)
    ref_loss, ref_grads = reference_loss_and_grads(**x, grad_out=g, **options)
    counted = int((x["target"] != -100).sum())
    if options["reduction"] == "mean" and counted == 0:
        assert torch.isnan(loss)
        return
    torch_loss, torch_grads = torch_loss_and_grads(**x, grad_out=g, **options)
    dtype = x["hidden"].dtype
    # cuBLAS rounds low-precision logits per GEMM shape (a one-row chunk may round a
    # logit to the other neighbour than the whole-matrix reference): one input-dtype
    # epsilon then bounds the loss difference.
    loss_tol = EPS[dtype] if DEVICE == "cuda" and dtype != torch.float32 else LOSS_TOL
    assert rel_err(loss.reshape(ref_loss.shape), ref_loss) <= \
        allowed_error(loss_tol, torch_loss, ref_loss)
    # bf16/fp16 sums across chunks in "input" mode round once per chunk; the interpreter
    # rounds bf16 by truncation (a GPU rounds to nearest), doubling the rounding error.
    chunks = -(-N // chunk_rows) if accumulator == "input" else 1
    tol = grad_tol(dtype, max(N, x["weight"].shape[0])) * max(1, chunks.bit_length()) \
        * (2 if DEVICE == "cpu" and dtype == torch.bfloat16 else 1)
    for name, grad in grads.items():
        if x[name] is not None:
            allowed = allowed_error(tol, torch_grads[name], ref_grads[name])
            assert rel_err(grad, ref_grads[name]) <= allowed, name


def test_triton_rows_read_strided_and_expanded_targets_and_class_weights():
    # The kernel indexes with unit stride: views (a column of a label tensor, an expanded
    # target, class weights with a step) must give what their contiguous copies give.
    x = _to_device(make_inputs(12, 8, 11, torch.float32, class_weight=True))
    labels = torch.stack([x["target"], torch.zeros_like(x["target"])], 1)
    wide_cw = torch.stack([x["class_weight"], torch.full_like(x["class_weight"], 9.0)], 1)
    options = dict(reduction="sum", label_smoothing=0.1, softcap=None, z_loss=0.0)
    for target, cw in ((labels[:, 0], wide_cw[:, 0]),
                       (torch.tensor(3, device=DEVICE).expand(12), x["class_weight"])):
        views = {**x, "target": target, "class_weight": cw}
        loss, grads = _triton_loss_and_grads(views, options, "fp32", 5, torch.tensor(1.0))
        copies = {**views, "target": target.contiguous(), "class_weight": cw.contiguous()}
        ref_loss, ref = reference_loss_and_grads(**copies, **options)
        assert rel_err(loss, ref_loss) <= LOSS_TOL
        for name in ("hidden", "weight"):
            assert rel_err(grads[name], ref[name]) <= grad_tol(torch.float32, 12), name


def test_triton_rows_out_of_range_target_gives_nan_not_a_crash():
    x = make_inputs(4, 3, 11, torch.float32, ignore_frac=0.0, device=DEVICE)
    x["target"][1] = 11
    with chunks(4, x["hidden"], x["weight"]):
        loss = linear_ce.fwd(x["hidden"], x["weight"], x["target"], None, None,
                             *CEOptions(reduction="none"), *ONE_DEVICE, [False] * 3, False,
                             backend=TRITON)[0]
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()


@pytest.mark.cuda
def test_triton_backend_is_registered_for_cuda():
    x = make_inputs(64, 16, 1000, torch.bfloat16, device="cuda")
    loss = torch.ops.fce.linear_ce(x["hidden"], x["weight"], x["target"])
    ref, _ = reference_loss_and_grads(**{k: v.cpu() if v is not None else None
                                         for k, v in x.items()})
    assert rel_err(loss.cpu(), ref) <= LOSS_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_kahan_gemm_rounds_once(dtype):
    from torch_fce.ops.loop.kahan import _launch_kahan_addmm

    g = torch.Generator().manual_seed(0)
    K, M, N = 19, 37, 21  # not multiples of the blocks
    s, c = (torch.zeros(M, N, dtype=dtype, device=DEVICE) for _ in range(2))
    exact = torch.zeros(M, N, dtype=torch.float64, device=DEVICE)
    for _ in range(40):
        a = torch.randn(K, M, generator=g).to(DEVICE, dtype)
        b = torch.randn(K, N, generator=g).to(DEVICE, dtype)
        _launch_kahan_addmm(a, b, s, c)
        exact += a.double().t() @ b.double()
    # Compensated: as close as rounding the exact sum once (plain sums drift past it).
    assert rel_err(torch.sub(s, c), exact) <= 1.1 * rel_err(exact.to(dtype), exact)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_rows_zero_non_finite_ignored_rows(reduction):
    x = _to_device(make_inputs(8, 4, 13, bias=True))
    ignored = 2
    x["target"][ignored] = -100
    x["hidden"][ignored] = float("nan")
    options = dict(reduction=reduction, label_smoothing=0.1, softcap=None, z_loss=1e-3)
    g = torch.ones(8, device=DEVICE) if reduction == "none" else torch.tensor(1.0)
    loss, grads = _triton_loss_and_grads(x, options, "fp32", 3, g.to(DEVICE))
    x["hidden"][ignored] = 0.0  # what an ignored row contributes: nothing
    ref, ref_grads = _triton_loss_and_grads(x, options, "fp32", 3, g.to(DEVICE))
    assert torch.isfinite(loss).all() and torch.equal(loss, ref)
    assert torch.equal(grads["hidden"], ref_grads["hidden"])


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA runs it through the CUDA backend tests")
def test_triton_kahan_accumulator_through_the_op(monkeypatch):
    from torch_fce.ops.loop import workspace
    from torch_fce.ops.machinery import dispatch

    from tests.helpers import TRITON, assert_matches_reference

    # the Triton backend on CPU tensors: its rows and the Kahan sums' GEMM kernel
    monkeypatch.setattr(dispatch, "backend_for", lambda hidden: TRITON)
    monkeypatch.setattr(workspace, "_nbytes", 256)
    x = make_inputs(64, 8, 31, torch.bfloat16, bias=True, weight_scale=4.0)
    opts = dict(reduction="sum", label_smoothing=0.1, softcap=None, z_loss=0.0)
    assert_matches_reference(x, opts, accumulator="kahan")


def test_triton_scale_cast_rounds_once():
    from torch_fce.ops.machinery.scale import _launch_scale_cast

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = torch.empty(5000, dtype=torch.bfloat16, device=DEVICE)
    _launch_scale_cast(x, torch.tensor(0.37, device=DEVICE), out)
    exact = x.double() * 0.37
    # One rounding of the float32 product: within one bfloat16 epsilon of the exact value
    # (the interpreter truncates where a GPU rounds to nearest; both pass).
    assert ((out.double() - exact).abs() <= EPS[torch.bfloat16] * exact.abs()).all()


@pytest.mark.parametrize("opts", [
    CEOptions(), CEOptions(label_smoothing=0.1), CEOptions(label_smoothing=0.2, softcap=3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("class_weight", [False, True])
def test_triton_shard_sweeps_match_their_pytorch_twins(opts, dtype, class_weight):
    # The vocab-parallel loss's Triton kernels against rows.torch_shard_*, which the
    # distributed tests tie to the single-device op; shards of an uneven split.
    g = torch.Generator().manual_seed(1)
    n, V, split = 9, 37, [0, 15, 37]
    logits = (torch.randn(n, V, generator=g) * 4).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[2] = -100
    cw = torch.rand(V, generator=g) + 0.5 if class_weight else None
    lse, a, b, c = (torch.randn(n, generator=g) for _ in range(4))
    lses = []
    for s, e in zip(split, split[1:]):
        col = torch.where((target >= s) & (target < e), target - s, -1).int()
        shard = logits[:, s:e]
        cws = None if cw is None else cw[s:e]
        mine = triton_shard_stats(shard.clone().to(DEVICE), col.to(DEVICE),
                                  None if cws is None else cws.to(DEVICE), opts,
                                  torch.float32)
        twin = torch_shard_stats(shard.clone(), col, cws, opts, torch.float32)
        for m, t in zip(mine, twin):
            assert (m is None) == (t is None) and (m is None or rel_err(m.cpu(), t) <= 1e-6)
        lses.append(twin[0])
        coeffs = (lse, a, b, c if opts.label_smoothing > 0.0 else None)
        dz = triton_shard_grad(shard.clone().to(DEVICE), col.to(DEVICE),
                               None if cws is None else cws.to(DEVICE),
                               *[None if v is None else v.to(DEVICE) for v in coeffs],
                               opts, torch.float32, dtype)
        want = torch_shard_grad(shard.clone(), col, cws, *coeffs, opts, torch.float32, dtype)
        assert dz.dtype == dtype and rel_err(dz.cpu(), want) <= 4 * EPS[dtype]
    # The shards' logsumexps combine to the whole row's.
    whole = torch_ce_stats(logits.clone(), target, None, opts, False, torch.float32).lse
    assert rel_err(torch.stack(lses).logsumexp(0), whole) <= 1e-6

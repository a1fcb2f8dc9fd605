"""The exp-GEMM pipeline (TORCH_FCE_BACKEND=exp, loop/exp_gemms.py): its PyTorch twin
against float64 on every option the cross entropy serves there, its fallbacks, its plan,
its one-hot scatter; on an sm_90 GPU with quack-kernels, the CuTe twin against the
PyTorch one and float64, batch invariance and no host sync."""

import pytest
import torch

import torch_fce
from tests.helpers import DEVICE, confident_inputs
from tests.references import logits_ce_reference, policy_reference
from torch_fce.ops.linear_ce import CEOptions, exp_rows
from torch_fce.ops.loop import exp_gemms, sparse
from torch_fce.ops.machinery.dispatch import backend_for, exp_on_cuda
from torch_fce.testing import make_inputs, rel_err

OPTION_SETS = [
    dict(reduction="mean"),
    dict(reduction="sum", z_loss=1e-3),
    dict(reduction="none", ignore_index=5),
    dict(reduction="mean", label_smoothing=0.1),
    dict(reduction="sum", label_smoothing=0.2, class_weight=True, z_loss=1e-4),
]


def _leaves(x):
    return x["hidden"].detach().clone().requires_grad_(), \
        x["weight"].detach().clone().requires_grad_()


def _run(x, backend, monkeypatch, **options):
    """Loss and (hidden, weight) gradients for a fixed upstream gradient, on a backend."""
    monkeypatch.setenv("TORCH_FCE_BACKEND", backend)
    h, w = _leaves(x)
    loss = torch_fce.linear_cross_entropy(h, w, x["target"], None, x["class_weight"],
                                          **options)
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(loss.device)
    loss.backward(g)
    return loss.detach(), h.grad, w.grad, g


def _float64(x, g, **options):
    """The float64 composition on the bf16 operands' exact logits (the pipeline's GEMM
    keeps its float32 sums: nothing is rounded to bf16 before the softmax)."""
    h, w = (t.detach().double().requires_grad_() for t in (x["hidden"], x["weight"]))
    loss = logits_ce_reference(h @ w.T, x["target"], x["class_weight"], **options)
    loss.backward(g.double())
    return loss.detach(), h.grad, w.grad


def _errors(x, backend, monkeypatch, **options):
    loss, gh, gw, g = _run(x, backend, monkeypatch, **options)
    ref = _float64(x, g, **options)
    return [rel_err(a, e) for a, e in zip((loss, gh, gw), ref)]


def _inputs(N, D, V, class_weight=False, seed=0, device="cpu", ignore_index=-100):
    x = make_inputs(N, D, V, torch.bfloat16, class_weight=class_weight, seed=seed,
                    ignore_frac=0.2, device=device)
    x["target"][x["target"] == -100] = ignore_index
    return x


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("V", [256, 384, 640])  # n-tiles of 256, 192 and 128
def test_exp_twin_matches_float64(options, V, monkeypatch):
    options = dict(options)
    x = _inputs(300, 24, V, options.pop("class_weight", False),
                ignore_index=options.get("ignore_index", -100))
    with torch_fce.workspace(128 * V * 3):  # chunks of 128 rows: a ragged third
        loss, gh, gw = _errors(x, "exp", monkeypatch, **options)
        rows = _errors(x, "triton", monkeypatch, **options)
    assert loss <= 1e-5
    # no less exact than the chunk loop (bf16 logits and dz), within bf16's rounding
    assert gh <= max(1.1 * rows[1], 1e-3) and gh <= 2 ** -7
    assert gw <= max(1.1 * rows[2], 1e-3) and gw <= 2 ** -7


def test_exp_twin_confident_rows(monkeypatch):
    h, w, t = confident_inputs(256, 16, 384, offset=30.0, spread=30.0)
    x = dict(hidden=h.bfloat16(), weight=w.bfloat16(), target=t, class_weight=None)
    loss, gh, gw = _errors(x, "exp", monkeypatch, reduction="sum", label_smoothing=0.1)
    rows = _errors(x, "triton", monkeypatch, reduction="sum", label_smoothing=0.1)
    assert loss <= max(1.1 * rows[0], 1e-5)
    assert gh <= max(1.1 * rows[1], 1e-3) and gw <= max(1.1 * rows[2], 1e-3)


def test_exp_twin_dft_as_float32_logits(monkeypatch):
    """dft (no float64 reference here): as the chunk loop on the float32 logits."""
    x = _inputs(200, 24, 384)
    a = _run(x, "exp", monkeypatch, dft=True)
    b = _run(x, "triton", monkeypatch, dft=True, logits_dtype=torch.float32)
    assert rel_err(a[0], b[0]) <= 1e-6
    assert rel_err(a[1], b[1]) <= 2 ** -8 and rel_err(a[2], b[2]) <= 2 ** -8


def test_exp_ignored_rows_reach_nothing(monkeypatch):
    """An ignored token's hidden state (NaN here) touches no output or gradient."""
    x = _inputs(130, 16, 256)
    x["target"][[3, 129]] = -100
    x["hidden"][[3, 129]] = float("nan")
    loss, gh, gw, _ = _run(x, "exp", monkeypatch, reduction="none")
    assert loss[[3, 129]].eq(0).all() and loss.isfinite().all()
    assert gh[[3, 129]].eq(0).all() and gh.isfinite().all() and gw.isfinite().all()


def _tile(M, V, seed, spread):
    """An ExpTile of M rows whose n-tiles' k lie up to `spread` apart (strips of every
    magnitude, 0 among them), a NaN row among them."""
    g = torch.Generator().manual_seed(seed)
    T = V // exp_gemms.tile_n_for(V)
    k = torch.randint(-spread, 60, (M, T), generator=g).float()
    k[1] = torch.randint(-5, 2, (T,), generator=g).float()  # a flat row
    sum_exp = 1.0 + torch.rand(M, T, generator=g) * 100
    sum_exp[2, 0] = float("nan")
    zy = (k[:, 0] + torch.randn(M, generator=g)) * exp_gemms.LN2
    return exp_gemms.ExpTile(None, *(a.to(DEVICE) for a in (sum_exp, k, zy)))


@pytest.mark.parametrize("options", OPTION_SETS + [dict(reduction="mean", dft=True)])
@pytest.mark.parametrize("V", [1536, 1280, 640])  # n-tiles of 192, 256 and 128
def test_exp_rows_triton_as_torch(options, V):
    """The row math's Triton kernel as its PyTorch twin: the strips bit for bit, the
    terms and coefficients to float32's rounding; padding rows past the tokens ignored."""
    from torch_fce.ops.linear_ce.exp_kernels import triton_exp_rows
    options = dict(options)
    cw = options.pop("class_weight", False)
    opts = CEOptions(**options)
    M, n = 272, 250
    g = torch.Generator().manual_seed(3)
    tile = _tile(M, V, 3, 200)
    target = torch.randint(0, V, (n,), generator=g)
    target[::7] = opts.ignore_index
    cweight = (torch.rand(V, generator=g) + 0.5).to(DEVICE) if cw else None
    scales = tuple(torch.rand(n, generator=g).to(DEVICE) for _ in range(2))
    zsum = torch.randn(M, generator=g).to(DEVICE)
    args = (tile, target.to(DEVICE), cweight, scales, opts, V, zsum)
    (ta, ga), (tb, gb) = exp_rows.exp_rows(*args), triton_exp_rows(*args)
    # lse, nll and smooth to float32's rounding; nll and smooth are differences with lse
    # (~40), so to its rounding as well where they are small
    for field, a, b in zip(ta._fields, ta[:3], tb[:3]):
        bound = 1e-6 * (1 + b.abs())
        if field != "lse":
            bound = bound + 2 ** -21 * tb.lse.nan_to_num(0.0).abs()
        bad = ~((a - b).abs() <= bound).logical_or(a.isnan() & b.isnan())
        assert not bad.any(), (field, bad.nonzero().flatten()[:8].tolist(), a[bad][:8].tolist(),
                               b[bad][:8].tolist())
    assert torch.equal(ga.u, gb.u) and torch.equal(ga.col, gb.col)
    # bf16(u v) of one v to float32's rounding: at most an ulp; products below 2^-126
    # (subnormal, nothing next to E's other terms) as the interpreter rounds them
    assert torch.allclose(ga.uv.float(), gb.uv.float(), rtol=2 ** -7, atol=2 ** -126,
                          equal_nan=True)
    # v = a e^(k_r ln2 - lse): lse's rounding (relative 2^-24 of |lse| ~ 40) in the
    # exponent; b and cs sums of terms that may cancel (smoothing, class weights, z-loss:
    # the GPU contracts them otherwise), to that rounding of the largest
    for a, b in zip((ga.v, ga.b, ga.cs), (gb.v, gb.b, gb.cs)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.nan_to_num(0).abs().max()),
                              equal_nan=True)
    assert gb.u.float().eq(0).any() and (gb.u.float() < 2 ** -100).logical_and(
        gb.u.float() > 0).any()  # the strips' tiny and zero entries were exercised
    assert ta.lse[2].isnan() and tb.lse[n:].isfinite().all() and tb.nll[n:].eq(0).all()
    assert gb.v[n:].eq(0).all() and gb.col[n:].eq(-1).all()
    assert exp_rows.exp_rows(*args[:3], None, *args[4:])[1] is None
    # the forward alone: nll = lse - z_y as the backward's compilation forms it, to the
    # rounding of lse, z_y and nll (the GPU contracts the two compilations otherwise)
    nll = triton_exp_rows(*args[:3], None, *args[4:])[0].nll
    assert torch.equal(nll.isnan(), tb.nll.isnan())
    bound = 2 ** -21 * (1 + tb.lse.abs() + tb.nll.abs())
    assert ((nll - tb.nll).abs() <= bound).logical_or(nll.isnan()).all()


@pytest.mark.parametrize("case", ["bias", "odd_V", "float32", "softcap", "kahan",
                                  "master_weight"])
def test_exp_not_served_runs_the_rows(case, monkeypatch):
    """What the pipeline does not serve runs the chunk loop: bitwise today's result."""
    V = 300 if case == "odd_V" else 256
    x = make_inputs(64, 16, V, torch.float32 if case == "float32" else torch.bfloat16,
                    bias=case == "bias", weight_dtype=torch.float32
                    if case == "master_weight" else None)
    options = dict(softcap=20.0) if case == "softcap" else \
        dict(accumulator="kahan") if case == "kahan" else {}
    h, w = x["hidden"], x["weight"]
    assert not (x["bias"] is None and case not in ("softcap", "kahan")
                and exp_gemms.served(h, w))
    out = []
    for backend in ("exp", "triton"):
        monkeypatch.setenv("TORCH_FCE_BACKEND", backend)
        leaves = [t.detach().clone().requires_grad_() for t in (h, w)]
        loss = torch_fce.linear_cross_entropy(*leaves, x["target"], x["bias"], **options)
        loss.backward()
        out.append([loss, leaves[0].grad, leaves[1].grad])
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_backend_variable_refused(monkeypatch):
    monkeypatch.setenv("TORCH_FCE_BACKEND", "cutlass")
    x = _inputs(4, 8, 128)
    with pytest.raises(ValueError, match="TORCH_FCE_BACKEND"):
        torch_fce.linear_cross_entropy(x["hidden"], x["weight"], x["target"])
    monkeypatch.setenv("TORCH_FCE_BACKEND", "exp")
    assert backend_for(x["hidden"]).exp
    monkeypatch.delenv("TORCH_FCE_BACKEND")
    assert not backend_for(x["hidden"]).exp


def test_one_hot_scatter_triton_as_torch():
    """exp_tail's dW one-hot term: the Triton kernel (the interpreter without a GPU) as
    PyTorch's index_add_, a class named by many tokens, entries of value 0, classes
    without entries untouched."""
    g = torch.Generator().manual_seed(0)
    N, V, D = 90, 13, 1100  # D over one block of 1024 (sparse_kernels._ADD_BLOCK_D)
    x = torch.randn(N, D, generator=g).half().to(DEVICE)
    cols = torch.randint(0, V, (N, 1), generator=g)
    cols[:40] = 3
    cols[cols == 7] = 8  # class 7: no entries
    cols = cols.to(DEVICE)
    vals = torch.randn(N, 1, generator=g).to(DEVICE)
    vals[5] = 0
    base = torch.randn(V, D, generator=g).to(DEVICE)
    a, b = base.clone(), base.clone()
    sparse.scatter_add(sparse.SparseGrad(cols, vals), x, a, triton=False)
    sparse.scatter_add(sparse.SparseGrad(cols, vals), x, b, triton=True)
    assert torch.equal(b[7], base[7])
    assert rel_err(b, a) <= 1e-6
    assert rel_err(b - base, a - base) <= 1e-6


SHAPES = {"D": (896, 151936), "E": (1536, 151936), "Q1024": (1024, 151936),
          "A": (4096, 128256)}


@pytest.mark.parametrize("shape", SHAPES)
def test_wave_plan(shape):
    """The dx GEMM's waves: the plan's rows are whole tiles within the workspace, and
    its modelled cost no more than the workspace's chunk at quack's dx tile unsplit (at
    D 896 that one spills 2816 rows' 154 tiles past 132 SMs: measured 1.49x cuBLAS's
    dx). The plan splits V where it measured faster on an H100 (Q1024: 2816 rows' 44
    clusters of 256 fill two waves thrice split), not where it measured slower (E, A)."""
    D, V = SHAPES[shape]
    N = 16384
    cap = 5504 if shape == "A" else 2816  # the default workspace's chunks on an H100
    rows, tiles = exp_gemms.wave_plan(N, D, V, cap, 132)
    assert rows % exp_gemms.ROWS == 0 and rows <= cap
    assert tiles.tile_n in (128, 192, 256) and tiles.split in (1, 2, 3, 4)
    cost = exp_gemms._chunk_cost(rows, N, D, V, tiles, 132)
    old = -(-(-(-N // -(-N // cap))) // 128) * 128, 192 if D % 192 == 0 else 256
    assert cost <= exp_gemms._chunk_cost(old[0], N, D, V, exp_gemms.DxTiles(old[1]), 132)
    if shape == "D":
        assert exp_gemms._chunk_cost(2816, N, D, V, exp_gemms.DxTiles(256), 132) >= 1.2 * cost
    if shape != "D":  # (D: 0.9% apart, within the run's noise)
        assert (tiles.split > 1) == (shape == "Q1024")
    assert exp_gemms.wave_plan(100, D, V, cap, 132)[0] == 128  # one tile of few tokens


# ---- the policy loss on the pipeline (a tempered logits GEMM) -----------------------

POLICY_SETS = [
    dict(loss_type="clip", epsilon_high=0.28, beta=0.04, kl="k3", temperature="token",
         old=True, ref=True),
    dict(loss_type="cispo", epsilon_high=5.0, temperature=0.7, old=True),
    dict(loss_type="sapo", temperature="sequence", token_weights=True, ref=True),
    dict(loss_type="reinforce", kl_ratio=True, beta=0.1, kl="k2", ref=True, old=True),
    dict(loss_type="clip", delta=1.5),  # no old log-probs: the ratio 1, its derivative lp's
]


def _policy_problem(spec, N, D, V, device="cpu", seed=0, confident=False):
    """(hidden, weight, target, options) of a POLICY_SETS entry, bf16 operands: a fifth
    of the tokens ignored (the last among them), old / ref log-probs near the current
    ones (some ratios clip), per-token or per-sequence temperatures."""
    spec = dict(spec)
    g = torch.Generator().manual_seed(seed)
    if confident:
        h, w, t = confident_inputs(N, D, V, offset=30.0, spread=30.0, seed=seed)
    else:
        x = make_inputs(N, D, V, torch.float32, seed=seed)
        h, w, t = x["hidden"], x["weight"] * 2, x["target"]
    h, w, t = h.bfloat16(), w.bfloat16(), t.clone()
    t[torch.rand(N, generator=g) < 0.2] = -100
    t[-1] = -100
    T = spec.pop("temperature", 1.0)
    if T == "token":
        T = torch.rand(N, generator=g) + 0.3
    elif T == "sequence":
        T = (torch.rand(2, generator=g) + 0.3).repeat_interleave(N // 2)
    with torch.no_grad():
        lp = torch_fce.linear_logprobs(h.float(), w.float(), t, temperature=T).logprob
    opts = dict(advantages=torch.randn(N, generator=g), temperature=T, **spec)
    for name, sign in (("old", 1.0), ("ref", -1.0)):
        if opts.pop(name, False):
            opts[f"{name}_logprobs"] = lp + sign * 0.3 * torch.randn(N, generator=g)
    if opts.pop("token_weights", False):
        opts["token_weights"] = torch.rand(N, generator=g)
    opts = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    return h.to(device), w.to(device), t.to(device), opts


def _policy_run(problem, backend, monkeypatch, double=False):
    """(loss, logprob, entropy, grad_hidden, grad_weight) of torch_fce on a backend, or
    of the float64 reference (double) on the same bf16 operands' exact logits."""
    h, w, t, opts = problem
    h, w = (x.detach().clone().to(torch.float64 if double else x.dtype).requires_grad_()
            for x in (h, w))
    opts = dict(opts)
    A = opts.pop("advantages")
    if double:
        old, ref = opts.pop("old_logprobs", None), opts.pop("ref_logprobs", None)
        loss, lp, ent = policy_reference(dict(hidden=h, weight=w), t, A, old, ref, **opts)
    else:
        monkeypatch.setenv("TORCH_FCE_BACKEND", backend)
        loss, stats = torch_fce.linear_policy_loss(h, w, t, A, **opts)
        lp, ent = stats.logprob, stats.entropy
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("spec", POLICY_SETS)
@pytest.mark.parametrize("V", [256, 384, 640])  # n-tiles of 256, 192 and 128
def test_exp_policy_twin_matches_float64(spec, V, monkeypatch):
    """The log-probs and entropies to float32's rounding (the GEMM's sums: nothing in
    bf16 before the softmax), the gradients within bf16's rounding of E and the strips
    and no less exact than the chunk loop; ragged chunks, ignored tokens."""
    problem = _policy_problem(spec, 300, 24, V)
    ref = _policy_run(problem, None, monkeypatch, double=True)
    with torch_fce.workspace(128 * V * 3):
        exp = _policy_run(problem, "exp", monkeypatch)
        rows = _policy_run(problem, "triton", monkeypatch)
    err, rows_err = ([rel_err(a, e) for a, e in zip(out, ref)] for out in (exp, rows))
    assert err[0] <= 1e-5 and err[1] <= 1e-6 and err[2] <= 1e-6
    for i in (3, 4):
        assert err[i] <= max(1.1 * rows_err[i], 1e-3) and err[i] <= 2 ** -7


def test_exp_policy_twin_confident_rows(monkeypatch):
    """Confident rows at large magnitudes (lse about 100 at T 0.7): the log-probs near 0
    and the small entropies held relative to k_r, not to the logits' magnitude."""
    problem = _policy_problem(POLICY_SETS[1], 256, 16, 384, confident=True)
    ref = _policy_run(problem, None, monkeypatch, double=True)
    exp = _policy_run(problem, "exp", monkeypatch)
    rows = _policy_run(problem, "triton", monkeypatch)
    err, rows_err = ([rel_err(a, e) for a, e in zip(out, ref)] for out in (exp, rows))
    assert err[1] <= 1e-5 and err[2] <= 1e-4, err
    assert err[3] <= max(1.1 * rows_err[3], 1e-3) and err[4] <= max(1.1 * rows_err[4], 1e-3)


def _policy_ignored_reach_nothing(device, monkeypatch):
    h, w, t, opts = _policy_problem(POLICY_SETS[0], 130, 16, 256, device=device)
    t[[3, 129]] = -100
    h[[3, 129]] = float("nan")
    if device == "cuda":  # values unchecked there (the CPU refuses a temperature of 0)
        opts["temperature"][[3, 129]] = 0.0
    loss, lp, ent, gh, gw = _policy_run((h, w, t, opts), "exp", monkeypatch)
    assert loss.isfinite() and lp[[3, 129]].eq(0).all() and ent[[3, 129]].eq(0).all()
    assert gh[[3, 129]].eq(0).all() and gh.isfinite().all() and gw.isfinite().all()


def test_exp_policy_ignored_tokens_reach_nothing(monkeypatch):
    """An ignored token's hidden state (NaN) touches no output or gradient (on the GPU
    nor its temperature of 0, whose 1 / T is NaN: test_cute_policy_...)."""
    _policy_ignored_reach_nothing("cpu", monkeypatch)


@pytest.mark.parametrize("V", [1536, 1280, 640])  # n-tiles of 192, 256 and 128
def test_policy_exp_rows_triton_as_torch(V):
    """The policy's row math on its Triton kernels as its PyTorch twin: log-probs and
    entropies to float32's rounding, the strips, col and b bit for bit, v to its
    rounding; padding rows past the tokens, ignored tokens (at a NaN temperature), a
    target out of range (NaN) and a NaN partial."""
    from torch_fce.ops.linear_policy_loss import exp_rows as policy_rows
    from torch_fce.ops.linear_policy_loss.exp_kernels import triton_policy_exp_rows
    M, n = 272, 250
    g = torch.Generator().manual_seed(4)
    tile = _tile(M, V, 4, 200)
    # sum_ey = sum e (y - k) of each n-tile: -sum_exp times a mean depth in [0, 6)
    sum_ey = -tile.sum_exp * torch.rand(tile.k.shape, generator=g).to(DEVICE) * 6
    tile = tile._replace(sum_ey=sum_ey.contiguous())
    target = torch.randint(0, V, (n,), generator=g)
    target[5] = V  # out of range: NaN log-prob
    valid = torch.rand(n, generator=g) > 0.15
    valid[5] = True
    inv_t = torch.rand(n, generator=g) + 0.5
    inv_t[~valid] = float("nan")
    up = torch.randn(n, generator=g)
    up[::11] = 0.0  # tokens with no gradient
    args = [a.to(DEVICE) for a in (target, valid, inv_t)]
    seen = []

    def upstream(lp, ent):
        seen.append((lp, ent))
        return torch.where(args[1], up.to(DEVICE), 0.0)

    ta = policy_rows.policy_exp_rows(tile, *args, V, upstream)
    tb = triton_policy_exp_rows(tile, *args, V, upstream)
    assert seen[0][0] is ta[0] and seen[1][1] is tb[1]  # upstream saw the outputs
    for a, b in zip(ta[:2], tb[:2]):  # log-probs about -40..0, entropies 0..10
        assert torch.equal(a.isnan(), b.isnan()) and a[~valid.to(DEVICE)].eq(0).all()
        ok = a.isnan() | ((a - b).abs() <= 2 ** -20 * (1 + a.abs()))
        assert ok.all(), (ok.logical_not().nonzero().flatten()[:8].tolist())
    assert ta[0][5].isnan() and ta[0][2].isnan() and ta[1][2].isnan()
    ga, gb = ta[2], tb[2]
    assert torch.equal(ga.u, gb.u) and torch.equal(ga.col, gb.col)
    assert torch.equal(ga.b, gb.b) and gb.cs.eq(0).all() and gb.v[n:].eq(0).all()
    assert gb.col[n:].eq(-1).all() and gb.col[:n][up.to(DEVICE) == 0].eq(-1).all()
    assert torch.allclose(ga.v, gb.v, rtol=2 ** -22, atol=0, equal_nan=True)
    assert torch.allclose(ga.uv.float(), gb.uv.float(), rtol=2 ** -7, atol=2 ** -126,
                          equal_nan=True)
    assert triton_policy_exp_rows(tile, *args, V, lambda lp, ent: None)[2] is None


def test_policy_exp_rows_triton_rows_alone_as_in_the_chunk():
    """A row's log-prob, entropy, strips and coefficients on the Triton kernels are the
    same bits in a chunk of 272 rows as in one of 40 (its last block of rows part
    masked, four padding rows)."""
    from torch_fce.ops.linear_policy_loss.exp_kernels import triton_policy_exp_rows
    V, M, n, m = 640, 272, 250, 40
    g = torch.Generator().manual_seed(5)
    tile = _tile(M, V, 5, 100)
    tile = tile._replace(sum_ey=(-tile.sum_exp * 2).contiguous())
    target = torch.randint(0, V, (n,), generator=g).to(DEVICE)
    valid = (torch.rand(n, generator=g) > 0.1).to(DEVICE)
    inv_t = (torch.rand(n, generator=g) + 0.5).to(DEVICE)
    up = torch.randn(n, generator=g).to(DEVICE)
    whole = triton_policy_exp_rows(tile, target, valid, inv_t, V, lambda lp, ent: up)
    part = exp_gemms.ExpTile(None, *(a[:m].contiguous() for a in tile[1:]))
    alone = triton_policy_exp_rows(part, target[:36], valid[:36], inv_t[:36], V,
                                   lambda lp, ent: up[:36])
    for a, b in zip(whole[:2], alone[:2]):
        assert torch.equal(a[:36].nan_to_num(7.0), b.nan_to_num(7.0))
    for a, b in zip((whole[2].v, whole[2].b, whole[2].col), (alone[2].v, alone[2].b,
                                                             alone[2].col)):
        assert torch.equal(a[:36].nan_to_num(7.0), b[:36].nan_to_num(7.0))
        assert b[36:].eq(-1 if b.dtype == torch.int64 else 0).all()  # padding rows
    T = tile.k.shape[1] * exp_gemms.tile_n_for(V) // exp_gemms.STRIP
    assert torch.equal(whole[2].u.view(T, M)[:, :m], alone[2].u.view(T, m))


@pytest.mark.parametrize("case", ["entropy_coef", "softcap", "top_p", "bias"])
def test_exp_policy_not_served_runs_the_rows(case, monkeypatch):
    """What the pipeline does not serve (the entropy's gradient, softcap, a truncation,
    a bias) runs the chunk loop: bitwise today's result."""
    h, w, t, opts = _policy_problem(POLICY_SETS[4], 64, 16, 256)  # finite at lp -inf
    opts.update({"entropy_coef": dict(entropy_coef=0.01), "softcap": dict(softcap=20.0),
                 "top_p": dict(top_p=0.9), "bias": {}}[case])
    bias = torch.randn(256) if case == "bias" else None
    out = []
    for backend in ("exp", "triton"):
        monkeypatch.setenv("TORCH_FCE_BACKEND", backend)
        leaves = [x.detach().clone().requires_grad_() for x in (h, w)]
        loss, stats = torch_fce.linear_policy_loss(*leaves, t, bias=bias, **opts)
        loss.backward()
        out.append([loss, stats.logprob, stats.entropy, leaves[0].grad, leaves[1].grad])
    for a, b in zip(*out):
        assert torch.equal(a, b)


# ---- the CuTe twin, on an sm_90 GPU with quack-kernels ----------------------------

_CUTE = torch.cuda.is_available() and exp_on_cuda(torch.cuda.current_device())
cute_only = pytest.mark.skipif(not _CUTE, reason="needs an sm_90 GPU and quack-kernels")


@cute_only
@pytest.mark.parametrize("V", [896, 1152, 1280])  # n-tiles of 128, 192, 256
def test_cute_pieces_as_twin(V):
    from torch_fce.ops.loop import exp_gemms_cute as cute
    M, D = 256, 136
    x = _inputs(M, D, V, device="cuda", seed=2)
    h, w, t = x["hidden"], x["weight"], x["target"]
    col = torch.where(t >= 0, t, -1)
    tile_n = exp_gemms.tile_n_for(V)
    a = exp_gemms.logits(h, w, col, tile_n, h.new_empty(M, V))
    b = cute.logits(h, w, col, tile_n, h.new_empty(M, V))
    assert rel_err(b.E, a.E) <= 2e-3 and rel_err(b.sum_exp, a.sum_exp) <= 2e-3
    assert rel_err(b.zy[t >= 0], a.zy[t >= 0]) <= 1e-5
    # tempered (the policy loss's): z t, and the entropy's partial sum_ey
    inv_t = 1.0 / (torch.rand(M, device="cuda") + 0.3)
    at = exp_gemms.logits(h, w, col, tile_n, h.new_empty(M, V), inv_t)
    bt = cute.logits(h, w, col, tile_n, h.new_empty(M, V), inv_t)
    assert rel_err(bt.E, at.E) <= 2e-3 and rel_err(bt.sum_exp, at.sum_exp) <= 2e-3
    assert rel_err(bt.sum_ey, at.sum_ey) <= 2e-3 and (bt.k - at.k).abs().max() <= 1
    assert torch.equal(bt.zy, b.zy)
    sc = (torch.ones(M, device="cuda"), torch.zeros(M, device="cuda"))
    _, g = exp_rows.exp_rows(a, torch.where(t >= 0, t, -100), None, sc,
                             CEOptions(reduction="sum"), V, None)
    r = torch.randn(D, device="cuda")
    o1, o2 = h.new_empty(M, D), h.new_empty(M, D)
    exp_gemms.dx(g, w, r, o1)
    for tiles in (exp_gemms.DxTiles(128), exp_gemms.DxTiles(256), exp_gemms.DxTiles(128, 3)):
        cute.dx(g, w, r, o2, tiles)
        assert rel_err(o2, o1) <= 2e-3
    d1, d2 = (torch.empty(V, D, device="cuda") for _ in range(2))
    for first in (True, False):
        exp_gemms.dw_add(g, h, d1, first)
        cute.dw_add(g, h, d2, first)
        assert rel_err(d2, d1) <= 1e-5


@cute_only
@pytest.mark.parametrize("options", OPTION_SETS)
def test_cute_matches_float64(options, monkeypatch):
    """At least as exact as the Triton rows, V an odd multiple of 128, a ragged last
    chunk, ignored rows."""
    options = dict(options)
    x = _inputs(2000, 256, 128 * 97, options.pop("class_weight", False), device="cuda",
                ignore_index=options.get("ignore_index", -100))
    with torch_fce.workspace(1024 * 128 * 97 * 3):
        loss, gh, gw = _errors(x, "exp", monkeypatch, **options)
        rows = _errors(x, "triton", monkeypatch, **options)
    assert loss <= max(1.1 * rows[0], 1e-5)
    assert gh <= 1.1 * rows[1] and gw <= 1.1 * rows[2]


@cute_only
def test_cute_batch_invariant_no_host_sync(monkeypatch):
    from tests.helpers import no_host_sync
    monkeypatch.setenv("TORCH_FCE_BACKEND", "exp")
    x = _inputs(1500, 128, 128 * 33, device="cuda", seed=3)
    h, w, t = x["hidden"], x["weight"], x["target"]
    whole = torch_fce.linear_cross_entropy(h, w, t, reduction="none")
    part = torch_fce.linear_cross_entropy(h[1000:1300], w, t[1000:1300], reduction="none")
    assert torch.equal(part, whole[1000:1300])
    leaves = _leaves(x)
    with no_host_sync():
        torch_fce.linear_cross_entropy(*leaves, t).backward()


@cute_only
@pytest.mark.parametrize("spec", POLICY_SETS)
def test_cute_policy_matches_float64(spec, monkeypatch):
    """The policy loss on the CuTe kernels: the log-probs and entropies to float32's
    rounding, the gradients within bf16's and no less exact than the Triton rows; V an
    odd multiple of 128, a ragged last chunk, ignored tokens."""
    V = 128 * 97
    problem = _policy_problem(spec, 2000, 256, V, device="cuda")
    ref = _policy_run(problem, None, monkeypatch, double=True)
    with torch_fce.workspace(1024 * V * 3):
        exp = _policy_run(problem, "exp", monkeypatch)
        rows = _policy_run(problem, "triton", monkeypatch)
    err, rows_err = ([rel_err(a, e) for a, e in zip(out, ref)] for out in (exp, rows))
    assert err[0] <= 1e-5 and err[1] <= 1e-5 and err[2] <= 1e-5, err
    assert err[3] <= max(1.1 * rows_err[3], 1e-3) and err[4] <= max(1.1 * rows_err[4], 1e-3)


@cute_only
def test_cute_policy_batch_invariant_no_host_sync_ignored(monkeypatch):
    """Per-token outputs bitwise batch-invariant, no host sync, and an ignored token's
    NaN hidden state and temperature of 0 (1 / T NaN: values unchecked on CUDA) reach
    nothing."""
    from tests.helpers import no_host_sync
    h, w, t, opts = _policy_problem(POLICY_SETS[0], 1500, 128, 128 * 33, device="cuda")
    monkeypatch.setenv("TORCH_FCE_BACKEND", "exp")
    A, T = opts["advantages"], opts["temperature"]
    _, whole = torch_fce.linear_policy_loss(h, w, t, A, temperature=T)
    _, part = torch_fce.linear_policy_loss(h[1000:1300], w, t[1000:1300], A[1000:1300],
                                           temperature=T[1000:1300])
    assert torch.equal(part.logprob, whole.logprob[1000:1300])
    assert torch.equal(part.entropy, whole.entropy[1000:1300])
    leaves = [x.detach().clone().requires_grad_() for x in (h, w)]
    with no_host_sync():
        torch_fce.linear_policy_loss(*leaves, t, **opts)[0].backward()
    _policy_ignored_reach_nothing("cuda", monkeypatch)

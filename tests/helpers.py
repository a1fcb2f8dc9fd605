"""What the tests share, in one place: the device, tolerances from each dtype's
epsilon, the CE's float64 and torch comparisons (the references themselves are in
tests/references.py), confident-row inputs, an op's implementation with a chosen
backend and chunk size, the CE's hypothesis problems, and the CUDA checks (no host
sync, graph capture). Builders the benchmarks use too (make_inputs, rel_err,
word_tokenizer) are in torch_fce/testing.py."""

import contextlib
import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import torch_fce
from torch_fce.ops.loop.chunked import ONE_DEVICE  # noqa: F401  (the tests take it from here)
from torch_fce.ops.machinery.dispatch import Backend

from tests.references import linear_ce_reference, logits_ce_reference
from torch_fce.testing import make_inputs, rel_err


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Machine epsilon of each dtype; the tolerances below derive from it.
EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10,
       torch.bfloat16: 2.0 ** -7}


def grad_tol(dtype, terms):
    """Relative L2 error allowed for a gradient against reference_loss_and_grads.

    One epsilon of the output dtype (the result is rounded once to it, and the logits
    gradient once before the GEMMs, as torch does), or the float32 error of summing
    `terms` products (random-walk growth, 4 sqrt(terms) epsilons), whichever is larger.
    """
    work = EPS[torch.float64 if dtype == torch.float64 else torch.float32]
    return max(EPS[dtype] if dtype != torch.float64 else 0.0, 4 * work * max(terms, 16) ** 0.5)


# The loss is float32 math on the same rounded logits as the reference.
LOSS_TOL = 64 * EPS[torch.float32]


def nan_row_inputs(row, seed):
    """(hidden, the same with row `row` NaN (a diverged step), weight, target, the other
    rows' mask) on DEVICE: 4 tokens, D 6, V 23."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(4, 6, generator=g).to(DEVICE), torch.randn(23, 6, generator=g).to(DEVICE)
    bad = h.clone()
    bad[row] = float("nan")
    others = torch.arange(4, device=DEVICE) != row
    return h, bad, w, torch.tensor([1, 2, 3, 4], device=DEVICE), others


def confident_inputs(N, D, V, *, offset=20.0, spread=20.0, seed=0):
    """float32 (hidden, weight, target) whose logits sit around `offset` (a constant
    first feature) with a spread of about `spread`, target the argmax of each row: the
    confident rows of a trained model at large magnitudes (lse about 70, half the rows
    with p(target) > 0.98 at V = 257)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64) * spread / D ** 0.5
    weight[:, 0], hidden[:, 0] = offset, 1.0
    target = (hidden @ weight.T).argmax(-1)
    return hidden.float(), weight.float(), target


def logprob_composition(target):
    """(hidden, weight) -> (logprob, entropy) through torch's log_softmax, target (N,)."""
    def fn(hidden, weight):
        logp = F.linear(hidden, weight).log_softmax(-1)
        return logp.gather(-1, target[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    return fn


def confident_grads(fn, dtype, inputs, seed=1):
    """Gradients w.r.t. (hidden, weight) of random upstream gradients on the logprob and
    entropy of fn(hidden, weight), for confident_inputs' (hidden, weight, target) at
    dtype."""
    hidden, weight, target = inputs
    g = torch.Generator().manual_seed(seed)
    g_lp, g_h = (torch.randn(target.shape, generator=g).to(hidden.device, dtype)
                 for _ in range(2))
    leaves = [hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()]
    lp, ent = fn(*leaves)
    return torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), leaves)


def reference_loss_and_grads(hidden, weight, target, bias=None, class_weight=None,
                             grad_out=None, **options):
    """float64 loss and gradients of docs/api.md's formula with the logits rounded as the op
    rounds them: products in hidden's dtype, everything after in float64.

    Returns (loss, dict of float64 gradients "hidden", "weight", "bias" for grad_out).
    """
    dtype = hidden.dtype
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    z = F.linear(h2, w, b).double().requires_grad_()
    loss = logits_ce_reference(z, target.reshape(-1), class_weight, **options)
    g = torch.ones_like(loss) if grad_out is None else grad_out.double().reshape(loss.shape)
    (dz,) = torch.autograd.grad(loss, z, g)
    grads = dict(hidden=(dz @ w.double()).reshape(hidden.shape), weight=dz.t() @ h2.double(),
                 bias=dz.sum(0))
    if options.get("reduction") == "none":
        loss = loss.reshape(target.shape)
    return loss.detach(), grads


def torch_loss_and_grads(hidden, weight, target, bias=None, class_weight=None,
                         grad_out=None, **options):
    """torch's own unfused path (as HF runs it): F.linear in the input dtype, float32
    loss math, autograd. Returns (loss, dict of gradients in the inputs' dtypes).

    Its error against reference_loss_and_grads is the yardstick for ill-conditioned
    problems, where no float32 implementation can meet a fixed relative tolerance.
    """

    leaves = {k: v.detach().clone().requires_grad_() for k, v in
              (("hidden", hidden), ("weight", weight), ("bias", bias)) if v is not None}
    loss = linear_ce_reference(leaves["hidden"], leaves["weight"], target, leaves.get("bias"),
                               class_weight, products_dtype=hidden.dtype,
                               math_dtype=torch.float32, **options)
    g = torch.ones_like(loss) if grad_out is None else grad_out.float().reshape(loss.shape)
    grads = torch.autograd.grad(loss, list(leaves.values()), g, allow_unused=True)
    return loss.detach(), dict(zip(leaves, grads))


def allowed_error(tol, torch_value, reference):
    """A tolerance, or twice the error torch's own path makes, whichever is larger."""
    return max(tol, 2.0 * rel_err(torch_value, reference))


@contextlib.contextmanager
def no_host_sync():
    """Inside the block, any CUDA call that synchronises with the host raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture_cuda_graph(step):
    """(graph, step()'s output captured in it): torch's recipe, two warm-up calls on a
    side stream, then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def run_op(x, options, accumulator="fp32", grad_seed=0):
    """Loss and gradients of hidden/weight/bias for a random upstream gradient."""
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")
              if x[k] is not None}
    args = {**x, **leaves}
    loss = torch_fce.linear_cross_entropy(**args, **options, accumulator=accumulator)
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_seed))
    grads = torch.autograd.grad(loss, list(leaves.values()), g) if loss.numel() else \
        [torch.zeros_like(v) for v in leaves.values()]
    return loss, dict(zip(leaves, grads)), g


def assert_matches_reference(x, options, accumulator="fp32", tol=None):
    loss, grads, g = run_op(x, options, accumulator)
    assert loss.dtype == torch.float32
    ref_loss, ref_grads = reference_loss_and_grads(**x, grad_out=g, **options)
    counted = (x["target"] != -100).sum().item()
    if options["reduction"] == "mean" and counted == 0:
        assert math.isnan(loss.item())  # as torch: 0 / 0
        assert all(torch.count_nonzero(v) == 0 for v in grads.values())
        return
    assert loss.shape == ref_loss.shape
    torch_loss, torch_grads = torch_loss_and_grads(**x, grad_out=g, **options)
    assert rel_err(loss, ref_loss) <= allowed_error(LOSS_TOL, torch_loss, ref_loss)
    tol = tol or grad_tol(x["hidden"].dtype, max(x["target"].numel(), x["weight"].shape[0]))
    for name, grad in grads.items():
        assert grad.dtype == x[name].dtype, name
        allowed = allowed_error(tol, torch_grads[name], ref_grads[name])
        assert rel_err(grad, ref_grads[name]) <= allowed, name


@st.composite
def ce_problems(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16),
             vocab=(2, 3, 31, 97, 257, 70001)):
    """Returns (inputs dict, options dict) for a random problem with every option."""
    N = draw(st.sampled_from([0, 1, 2, 7, 33]))
    D = draw(st.sampled_from([1, 4, 17, 127]))
    V = draw(st.sampled_from(vocab))
    dtype = draw(st.sampled_from(dtypes))
    master = dtype != torch.float32 and draw(st.booleans())
    x = make_inputs(
        N, D, V, dtype, ignore_frac=draw(st.sampled_from([0.0, 0.2, 1.0])),
        bias=draw(st.booleans()), class_weight=draw(st.booleans()),
        weight_dtype=torch.float32 if master else None, seed=draw(st.integers(0, 2**16)),
        weight_scale=draw(st.sampled_from([1.0, 4.0])),
    )
    if draw(st.booleans()) and N > 0:  # a (B, T) batch shape, B > 1 where N allows
        B = next(b for b in (3, 2, 1) if N % b == 0)
        x["hidden"] = x["hidden"].reshape(B, N // B, D)
        x["target"] = x["target"].reshape(B, N // B)
    options = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        softcap=draw(st.sampled_from([None, 2.0, 30.0])),
        z_loss=draw(st.sampled_from([0.0, 1e-2])),
    )
    return x, options


# ---- an op's implementation with a chosen backend and chunk size: one device's row
# functions on the shared loop, called directly (no dispatcher, no value checks)

TORCH = Backend(triton=False, check_values=False)
TRITON = Backend(triton=True, check_values=False)
BACKENDS = {"torch_rows": TORCH, "triton_rows": TRITON}


def dz_over_inputs(dtype, k):
    """(h, w, idx, g) for the sparse-target ops' 16-bit dz written over float32 logits
    (triton/ce.dz_over): 16-bit h (5, 8) and w (9001, 8), so a row spans three
    4096-class blocks, and k classes a token (int64), the first the last block's last
    class, the second class 1 (its dz lands over its own block's logits); g, the
    generator, draws the op's other inputs."""
    g = torch.Generator().manual_seed(8)
    N, D, V = 5, 8, 9001
    h = torch.randn(N, D, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(V, D, generator=g).to(dtype).to(DEVICE)
    idx = torch.randint(0, V, (N, k), generator=g)
    idx[:, 0], idx[:, 1] = V - 1, 1
    return h, w, idx.to(DEVICE), g


@contextlib.contextmanager
def chunks(rows, hidden, weight):
    """The loop cuts `rows` token rows per chunk (a workspace of that many logits rows)."""
    with torch_fce.workspace(rows * weight.shape[0] * hidden.element_size()):
        yield


def trainer_loss_step(trainer, batch, mode):
    """(loss, {name: gradient}) of one compute_loss + backward of a TRL trainer's model
    in train or eval mode (the trainers' integration tests compare both paths with it)."""
    model = trainer.model
    model.train(mode == "train")
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}

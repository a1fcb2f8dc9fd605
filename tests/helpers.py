"""What the tests share: tolerances from each dtype's epsilon, the float64 and torch
references, confident-row inputs, and the CUDA checks (no host sync, graph capture).
Builders the benchmarks use too (make_inputs, rel_err, word_tokenizer) are in
torch_fce/testing.py."""

import contextlib

import torch
import torch.nn.functional as F

from tests.references import linear_ce_reference, logits_ce_reference
from torch_fce.testing import rel_err


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

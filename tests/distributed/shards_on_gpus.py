"""Every vocab-parallel family on the GPU's own kernels at a real size (N 8192, D 2048,
V 128256), against one process on the same GPU: the body that
test_vocab_parallel_nccl.py (two GPUs, NCCL) and test_vocab_parallel_one_gpu.py (two
processes on one GPU over gloo) both run. Each rank compares its shard's outputs and
gradients (its rows of the weight's and bias's) with the whole head's, within the
tolerances of the gloo tests (tests/distributed/test_vocab_parallel.py)."""

import gc
import math
import sys

import torch
import torch.utils._pytree as pytree

import torch_fce
from torch_fce.distributed import (vocab_parallel_linear_cross_entropy,
                                   vocab_parallel_linear_distillation_loss,
                                   vocab_parallel_linear_logprobs,
                                   vocab_parallel_linear_policy_loss,
                                   vocab_parallel_linear_soft_cross_entropy,
                                   vocab_parallel_linear_sparse_divergence,
                                   vocab_parallel_linear_topk_logprobs)
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import LOSS_TOL, grad_tol

N, D, V = 8192, 2048, 128256
CE_FAMILIES = [
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.bfloat16, bias=True, class_weight=True, label_smoothing=0.1,
         softcap=30.0, z_loss=1e-4),
    dict(dtype=torch.bfloat16, accumulator="kahan", reduction="sum"),
    dict(dtype=torch.float32, reduction="none", label_smoothing=0.1),
]


def shard_bounds(world, uneven):
    """Each rank's first class, and V: equal shards, or the first rank's 3/11 of V."""
    if not uneven:
        return [V * r // world for r in range(world + 1)]
    first = 3 * V // 11
    return [0] + [first + (V - first) * r // (world - 1) for r in range(world)]


def _float_leaves(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and
            t.is_floating_point()]


def _objective(out, seed, rows=None):
    """A random combination of an op's differentiable outputs (-inf entries: 0), over
    the rows flagged in rows (N,) bool (None: all)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = 0.0
    for t in _float_leaves(out):
        if t.requires_grad:
            w = torch.randn(t.shape, generator=g, device="cuda")
            if rows is not None:
                w = w * rows.view(-1, *[1] * (t.dim() - 1))
            total = total + (torch.where(t.isfinite(), t, 0.0).float() * w).sum()
    return total


def _compare(name, one, parallel, leaves, bounds, rank, tol, scale=None, rows_apart=0.0):
    """one(*leaves) against parallel(*this rank's leaves, vocab_start=, vocab_size=):
    every float output (the same -inf entries), then the gradients of a random
    combination of them. scale: the magnitude of a scalar output's terms, where they
    cancel (its error is then relative to that, not to the sum). rows_apart: the
    fraction of a per-token output's rows that may differ (by at most 0.1, -inf
    included), the rest held to LOSS_TOL and the gradients taken over the rest only: a
    truncation's kept set is a step function of the logits, so a logit the shard's GEMM
    rounds apart from the whole head's moves the rows whose boundary lies within that
    rounding (a moved row's gradient is another kept set's)."""
    start, end = bounds[rank], bounds[rank + 1]
    full = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
    mine = [full[0].detach().clone().requires_grad_()] + [
        t.detach()[start:end].clone().requires_grad_() for t in full[1:]]
    want, got = one(*full), parallel(*mine, vocab_start=start, vocab_size=V)
    same = None  # the rows no kept set moved in: the gradients' objective
    for a, r in zip(_float_leaves(got), _float_leaves(want)):
        finite = r.isfinite()
        apart = a.isfinite() != finite
        a, r = torch.where(finite, a, 0.0), torch.where(finite, r, 0.0)
        if rows_apart:  # the rows a kept set moved in: few, each by at most 0.1
            moved = apart | ((a - r).abs() > LOSS_TOL * r.abs().clamp_min(1.0))
            assert float(moved.float().mean()) <= rows_apart, (name, int(moved.sum()))
            assert float(torch.where(moved & ~apart, (a - r).abs(), 0.0).max()) <= 0.1, name
            same = ~moved if same is None else same & ~moved
            a, r = a[~moved], r[~moved]
        else:
            assert not apart.any(), name
        err = rel_err(a, r) if scale is None else float((a - r).abs().max()) / scale
        assert err <= LOSS_TOL, (name, err, scale)
    objective = _objective(want, 1, same)
    if not isinstance(objective, torch.Tensor):  # no gradient (the top-k)
        return got, want
    want_g = torch.autograd.grad(objective, full)
    got_g = torch.autograd.grad(_objective(got, 1, same), mine)
    for i, (a, r) in enumerate(zip(got_g, want_g)):
        r = r if i == 0 else r[start:end]
        assert rel_err(a, r) <= tol, (name, i, rel_err(a, r))
    return got, want


def check_every_family(rank, world):
    """Every family's vocab-parallel op on this rank's shard of cuda's head, against the
    whole head in this process; equal and uneven shards. Each check is named on stderr
    before it runs (a rank that crashes in a collective leaves no traceback)."""
    checks = []
    for uneven in (False, True):
        bounds = shard_bounds(world, uneven)
        checks += [(f"cross entropy {f}", _check_cross_entropy, (rank, bounds, dict(f)))
                   for f in (CE_FAMILIES if not uneven else CE_FAMILIES[1:2])]
        checks += [(fn.__name__, fn, (rank, bounds))
                   for fn in (_check_logprobs, _check_distillation, _check_sparse)]
    checks.append(("DTensor and FSDP2", _check_dtensor_and_fsdp2, (rank, world)))
    for name, check, args in checks:
        print(f"rank {rank}: {name}, uneven {args[1] != shard_bounds(world, False)}",
              file=sys.stderr, flush=True)
        check(*args)
        # the ranks may share one GPU (the gloo test): each hands back its cache, and
        # says its peak
        gc.collect()
        torch.cuda.empty_cache()
        print(f"rank {rank}: passed, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} "
              "GiB", file=sys.stderr, flush=True)
        torch.cuda.reset_peak_memory_stats()


def _check_cross_entropy(rank, bounds, family):
    dtype = family.pop("dtype")
    x = make_inputs(N, D, V, dtype, bias=family.pop("bias", False),
                    class_weight=family.pop("class_weight", False), device="cuda", seed=3)
    cw, target = x["class_weight"], x["target"]
    leaves = [x["hidden"], x["weight"]] + ([x["bias"]] if x["bias"] is not None else [])

    def one(h, w, b=None):
        return torch_fce.linear_cross_entropy(h, w, target, b, cw, **family)

    def parallel(h, w, b=None, **shard):
        return vocab_parallel_linear_cross_entropy(h, w, target, b, cw, **shard, **family)

    _compare(f"cross entropy {family}", one, parallel, leaves, bounds, rank,
             grad_tol(dtype, N) * (2 if family.get("accumulator") == "kahan" else 1))


def _check_logprobs(rank, bounds):
    # the log-probs with entropy at temperature 0.7, under the sampler's truncation
    # (top_k, top_p and min_p alone), and the policy loss (DAPO's clip with a k3 KL)
    x = make_inputs(N, D, V, torch.bfloat16, bias=True, device="cuda", seed=11)
    target, tol = x["target"], grad_tol(torch.bfloat16, N)
    leaves = [x["hidden"], x["weight"], x["bias"]]
    # the truncations on float32 logits: a shard's GEMM has another shape than the whole
    # head's, so cuBLAS may round its bfloat16 logits apart by a unit (2^-8 of a logit),
    # which moves most kept sets of the rows it touches (on an H100 at 3a4c8db, uneven
    # shards: top_k=50 top_p=0.95 102 of the last chunk's 128 rows, top_p=0.9 508 rows;
    # in float32 none beyond 1e-5 under top_k=50 top_p=0.95, the control run
    # data/raw/vocab_parallel_truncation_fp32_control_h100_3a4c8db.txt);
    # float32's unit of 2^-24 leaves the few boundaries within it: top_k and top_p end K
    # at one class; min_p's floor (max - 3 at T 0.7) has about 1800 classes a unit of z
    # at this size, and a row moves if any of them is rounded across it (on an H100 at
    # 750bc9f, uneven shards: 31 of 8192 rows)
    for truncation, apart in ((dict(), 0.0), (dict(top_k=50, top_p=0.95), 0.002),
                              (dict(top_p=0.9), 0.002), (dict(min_p=0.05), 0.01)):
        opts = dict(truncation, temperature=0.7, entropy=True)
        if truncation:
            opts["logits_dtype"] = torch.float32
        _compare(f"log-probs {opts}", lambda h, w, b: torch_fce.linear_logprobs(
            h, w, target, b, **opts)[:2], lambda h, w, b, **shard: vocab_parallel_linear_logprobs(
            h, w, target, b, **shard, **opts)[:2], leaves, bounds, rank, tol,
            rows_apart=apart)
    with torch.no_grad():
        lp = torch_fce.linear_logprobs(x["hidden"], x["weight"], target, x["bias"],
                                       temperature=0.7).logprob
    g = torch.Generator(device="cuda").manual_seed(2)
    policy = dict(old_logprobs=lp + 0.2 * torch.randn(N, generator=g, device="cuda"),
                  ref_logprobs=lp + 0.1, beta=0.04, kl="k3", epsilon_high=0.28,
                  temperature=0.7)
    A = torch.randn(N, generator=g, device="cuda")
    # the mean of A_i ratio_i over random-sign A cancels: its error is relative to the
    # terms' size (on an H100, 8.4e-6 of the loss itself, above LOSS_TOL)
    _compare("policy loss", lambda h, w, b: torch_fce.linear_policy_loss(
        h, w, target, A, b, **policy), lambda h, w, b, **shard:
        vocab_parallel_linear_policy_loss(h, w, target, A, b, **shard, **policy),
        leaves, bounds, rank, tol, scale=float(A.abs().mean()))


def _check_distillation(rank, bounds):
    # the dense divergence (beta 0.5, a hard loss beside it) of a 1024-wide teacher
    x = make_inputs(N, D, V, torch.bfloat16, device="cuda", seed=17)
    t = make_inputs(N, 1024, V, torch.bfloat16, device="cuda", seed=18)
    start, end = bounds[rank], bounds[rank + 1]
    opts = dict(beta=0.5, hard_weight=0.2, temperature=0.9)
    _compare("distillation", lambda h, w: torch_fce.linear_distillation_loss(
        h, w, t["hidden"], t["weight"], x["target"], **opts), lambda h, w, **shard:
        vocab_parallel_linear_distillation_loss(h, w, t["hidden"], t["weight"][start:end],
                                                x["target"], **shard, **opts),
        [x["hidden"], x["weight"]], bounds, rank, grad_tol(torch.bfloat16, N))


def _check_sparse(rank, bounds):
    # a teacher's top-16 on its Triton kernels (the same classes where the logits agree:
    # shard and whole GEMMs may round a logit apart), then the student's sparse
    # divergence over it (tail on and off) and the soft cross entropy on it
    x = make_inputs(N // 4, D, V, torch.bfloat16, bias=True, device="cuda", seed=5)
    h, w, b, target = x["hidden"], x["weight"], x["bias"], x["target"]
    got, want = _compare("top-k", lambda h, w, b: torch_fce.linear_topk_logprobs(
        h, w, 16, b, target=target, temperature=0.9), lambda h, w, b, **shard:
        vocab_parallel_linear_topk_logprobs(h, w, 16, b, target=target, temperature=0.9,
                                            **shard), [h, w, b], bounds, rank, math.inf)
    assert (got.indices == want.indices).all(-1).float().mean() >= 0.99
    support, teacher = want.indices, want.logprobs - 0.05  # a teacher near the student
    tol = grad_tol(torch.bfloat16, N)
    # a divergence near 0 sums p (log p - log q) over the support, which cancel; each log q
    # is z - lse, rounded as |lse| is: its error relative to the student's mean |lse| (on
    # an H100, 1.5e-5 of the loss itself and 3.4e-5 of the teacher's mean sum of
    # p |log p|, 2026-12-06 and 2026-12-07)
    scale = float(torch_fce.linear_logprobs(h, w, target, b).lse.abs().mean())
    for opts in (dict(beta=0.0, tail=True), dict(beta=0.5, tail=False, softcap=30.0)):
        _compare(f"sparse divergence {opts}", lambda h, w, b:
                 torch_fce.linear_sparse_divergence(h, w, support, teacher, b, **opts),
                 lambda h, w, b, **shard: vocab_parallel_linear_sparse_divergence(
                     h, w, support, teacher, b, **shard, **opts), [h, w, b], bounds, rank, tol,
                 scale)
    probs = teacher.exp()
    _compare("soft cross entropy", lambda h, w, b: torch_fce.linear_soft_cross_entropy(
        h, w, support, probs, b, temperature=0.8), lambda h, w, b, **shard:
        vocab_parallel_linear_soft_cross_entropy(h, w, support, probs, b, temperature=0.8,
                                                 **shard), [h, w, b], bounds, rank, tol)


class _Head(torch.nn.Module):
    """An embedding and the head, the loss through torch_fce (FSDP2 shards both)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D, device="cuda", dtype=torch.bfloat16)
        self.head = torch.nn.Linear(D, V, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, ids):
        return torch_fce.linear_cross_entropy(self.embed(ids), self.head.weight, ids,
                                              shift=True)


def _check_dtensor_and_fsdp2(rank, world):
    # a Shard(0) DTensor head (torch's even chunks) through torch_fce.linear_cross_entropy;
    # FSDP2 gathering the head as usual, each rank on its own batch, the averaged
    # gradients against one process on the whole batch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    x = make_inputs(N, D, V, torch.bfloat16, bias=True, device="cuda", seed=9)
    full = [x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    ref = torch_fce.linear_cross_entropy(full[0], full[1], x["target"], full[2],
                                         label_smoothing=0.1)
    ref_g = torch.autograd.grad(ref, full)
    h = x["hidden"].clone().requires_grad_()
    w, b = (distribute_tensor(x[k], mesh, [Shard(0)]).requires_grad_()
            for k in ("weight", "bias"))
    loss = torch_fce.linear_cross_entropy(h, w, x["target"], b, label_smoothing=0.1)
    got_g = torch.autograd.grad(loss, [h, w, b])
    tol = grad_tol(torch.bfloat16, N)
    assert rel_err(loss, ref) <= LOSS_TOL
    assert rel_err(got_g[0], ref_g[0]) <= tol
    for a, r in zip(got_g[1:], ref_g[1:]):
        assert rel_err(a.full_tensor(), r) <= tol

    ids = torch.randint(0, V, (world, 4, 1024), generator=torch.Generator().manual_seed(4))
    ids = ids.cuda()
    one = _Head()
    torch.stack([one(ids[r]) for r in range(world)]).float().mean().backward()
    model = fully_shard(_Head(), mesh=mesh)
    model(ids[rank]).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), one.named_parameters()):
        assert rel_err(p.grad.full_tensor(), q.grad) <= 2 * tol, name

"""Vocab-parallel loss on 2 and 4 gloo ranks equals the single-process op."""

import contextlib
import itertools
import math
import os
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_fce
from torch_fce.distributed import (vocab_parallel_linear_cross_entropy,
                                   vocab_parallel_linear_distillation_loss,
                                   vocab_parallel_linear_logprobs,
                                   vocab_parallel_linear_policy_loss,
                                   vocab_parallel_linear_soft_cross_entropy,
                                   vocab_parallel_linear_sparse_divergence,
                                   vocab_parallel_linear_topk_logprobs)
from torch_fce.ops.machinery import dispatch
from torch_fce.testing import make_inputs, rel_err
from tests.helpers import (
    LOSS_TOL, TRITON, confident_grads, confident_inputs, grad_tol, logprob_composition)

V = 37
FAMILIES = [
    dict(), dict(reduction="sum"), dict(reduction="none"), dict(label_smoothing=0.1),
    dict(softcap=5.0), dict(z_loss=1e-3), dict(class_weight=True), dict(bias=True),
    dict(ignore_index=2), dict(dtype=torch.bfloat16, accumulator="kahan"),
    dict(dtype=torch.bfloat16, accumulator="input", bias=True, label_smoothing=0.2),
    dict(dtype=torch.float16, softcap=5.0), dict(dft=True),
    dict(dft=True, reduction="none", class_weight=True, softcap=5.0),
]
SPLITS = {2: [0, 15, V], 4: [0, 5, 17, 30, V]}  # uneven shards


def _grads(loss_fn, leaves, seed):
    loss = loss_fn()
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed))
    return loss.detach(), torch.autograd.grad(loss, leaves, g)


def _check_family(rank, world, family):
    family = dict(family)
    dtype = family.pop("dtype", torch.float32)
    x = make_inputs(24, 8, V, dtype, ignore_frac=0.2, bias=family.pop("bias", False),
                    class_weight=family.pop("class_weight", False), seed=7, weight_scale=2.0)
    if family.get("ignore_index") == 2:
        x["target"][x["target"] == -100] = 2
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    full = {k: x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")
            if x[k] is not None}
    ref_loss, ref = _grads(lambda: torch_fce.linear_cross_entropy(**{**x, **full}, **family),
                           list(full.values()), seed=3)
    mine = {"hidden": x["hidden"].clone().requires_grad_(),
            "weight": x["weight"][start:end].clone().requires_grad_()}
    if x["bias"] is not None:
        mine["bias"] = x["bias"][start:end].clone().requires_grad_()
    loss, grads = _grads(lambda: vocab_parallel_linear_cross_entropy(
        mine["hidden"], mine["weight"], x["target"], mine.get("bias"), x["class_weight"],
        vocab_start=start, vocab_size=V, **family), list(mine.values()), seed=3)
    assert rel_err(loss, ref_loss) <= LOSS_TOL, family
    expected = dict(zip(full, ref))
    tol = grad_tol(dtype, V) * (4 if family.get("accumulator") == "input" else 1)
    for (name, grad) in zip(mine, grads):
        want = expected[name] if name == "hidden" else expected[name][start:end]
        assert rel_err(grad, want) <= tol, (family, name)


def _check_uneven_shards_over_many_chunks(rank, world):
    # Chunk sizes must agree across ranks whatever their shard sizes: 3-row CPU chunks
    # (the shard sizes differ, 5 to 22 rows), every option family's statistics per chunk.
    with torch_fce.workspace(3 * -(-V // world) * 4):  # float32 logits
        for family in (dict(), dict(label_smoothing=0.1, class_weight=True, z_loss=1e-3)):
            _check_family(rank, world, family)


def _check_out_of_range_target(rank, world):
    # A target in no shard: the CPU raises as the op does; elsewhere the loss is NaN.
    x = make_inputs(8, 8, V, seed=2)
    x["target"][3] = V + 1
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    with pytest.raises(IndexError, match="outside"):
        vocab_parallel_linear_cross_entropy(x["hidden"], x["weight"][start:end],
                                            x["target"], vocab_start=start, vocab_size=V)
    from torch_fce.ops.loop.tokens import counted_target_weights

    _, w_y = counted_target_weights(x["target"], None, -100, V, torch.float32)
    assert torch.isnan(w_y[3]) and not torch.isnan(w_y[torch.arange(8) != 3]).any()


def _check_compiled(rank, world):
    # Functional collectives inside the autograd.Function: one graph, same numbers.
    x = make_inputs(16, 8, V, seed=5)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]

    def loss_fn(h, w, t):
        return vocab_parallel_linear_cross_entropy(h, w, t, vocab_start=start, vocab_size=V)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (compiled, loss_fn):
        h = x["hidden"].clone().requires_grad_()
        w = x["weight"][start:end].clone().requires_grad_()
        loss = fn(h, w, x["target"])
        loss.backward()
        runs.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*runs):
        assert rel_err(a, b) <= 1e-6


def _check_frozen_weight_and_no_grad(rank, world):
    # The forward forms only the gradients asked for, and none without grad mode.
    x = make_inputs(16, 8, V, seed=11)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    ref_h = x["hidden"].clone().requires_grad_()
    ref = torch_fce.linear_cross_entropy(ref_h, x["weight"], x["target"], z_loss=1e-3)
    ref.backward()
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"][start:end]
    loss = vocab_parallel_linear_cross_entropy(h, w, x["target"], vocab_start=start,
                                               vocab_size=V, z_loss=1e-3)
    loss.backward()
    assert rel_err(h.grad, ref_h.grad) <= grad_tol(torch.float32, V)
    with torch.no_grad():
        loss = vocab_parallel_linear_cross_entropy(h, w, x["target"], vocab_start=start,
                                                   vocab_size=V, z_loss=1e-3)
    assert loss.grad_fn is None and rel_err(loss, ref) <= LOSS_TOL


def _check_dtensor(world):
    # torch_fce.linear_cross_entropy with a Shard(0) DTensor weight (torch's even chunks).
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = make_inputs(16, 8, V, bias=True, seed=9)
    leaves = {k: x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    ref = torch_fce.linear_cross_entropy(**{**x, **leaves}, label_smoothing=0.1)
    ref.backward()
    h = x["hidden"].clone().requires_grad_()
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(x["bias"], mesh, [Shard(0)]).requires_grad_()
    loss = torch_fce.linear_cross_entropy(h, w, x["target"], b, label_smoothing=0.1)
    loss.backward()
    assert rel_err(loss, ref) <= LOSS_TOL
    assert rel_err(h.grad, leaves["hidden"].grad) <= grad_tol(torch.float32, V)
    assert rel_err(w.grad.full_tensor(), leaves["weight"].grad) <= grad_tol(torch.float32, V)
    assert rel_err(b.grad.full_tensor(), leaves["bias"].grad) <= grad_tol(torch.float32, V)


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, 8)
        self.head = torch.nn.Linear(8, V, bias=False)

    def forward(self, ids):
        return torch_fce.linear_cross_entropy(torch.tanh(self.embed(ids)), self.head.weight,
                                              ids, shift=True)


def _check_fsdp2(rank, world):
    # FSDP2 gathers the head as usual; the op sees a plain weight. Each rank trains on its
    # own batch; the averaged gradients equal one process on the whole batch.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    ids = torch.randint(0, V, (world, 2, 6), generator=torch.Generator().manual_seed(4))
    ref = _TinyLM()
    torch.stack([ref(ids[r]) for r in range(world)]).mean().backward()
    model = fully_shard(_TinyLM(), mesh=init_device_mesh("cpu", (world,)))
    model(ids[rank]).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad.full_tensor(), q.grad) <= 1e-5, name


def _check_logprobs(rank, world):
    # linear_logprobs over uneven shards and many chunks (3-row workspace), and through a
    # Shard(0) DTensor weight, against one process: outputs and gradients for random
    # upstream gradients on log-probs and entropies.
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    x = make_inputs(24, 8, V, ignore_frac=0.2, bias=True, seed=11, weight_scale=2.0)
    T = torch.rand(24, generator=torch.Generator().manual_seed(5)) + 0.5
    g = torch.Generator().manual_seed(6)
    g_lp, g_h = torch.randn(24, generator=g), torch.randn(24, generator=g)
    opts = dict(temperature=T, softcap=4.0, entropy=True)

    def run(fn, leaves):
        out = fn(leaves)
        grads = torch.autograd.grad((out.logprob * g_lp).sum() + (out.entropy * g_h).sum(),
                                    list(leaves.values()))
        return out, grads

    full = {k: x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    ref, ref_grads = run(lambda l: torch_fce.linear_logprobs(
        l["hidden"], l["weight"], x["target"], l["bias"], **opts), full)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    mine = {"hidden": x["hidden"].clone().requires_grad_(),
            "weight": x["weight"][start:end].clone().requires_grad_(),
            "bias": x["bias"][start:end].clone().requires_grad_()}
    with torch_fce.workspace(3 * -(-V // world) * 4):
        out, grads = run(lambda l: vocab_parallel_linear_logprobs(
            l["hidden"], l["weight"], x["target"], l["bias"], vocab_start=start,
            vocab_size=V, **opts), mine)
    for a, b in zip(out[:3], ref[:3]):
        assert rel_err(a, b) <= LOSS_TOL
    assert torch.equal(out.argmax, ref.argmax)
    tol = grad_tol(torch.float32, V)
    assert rel_err(grads[0], ref_grads[0]) <= tol
    assert rel_err(grads[1], ref_grads[1][start:end]) <= tol
    assert rel_err(grads[2], ref_grads[2][start:end]) <= tol

    # A float temperature and a per-sequence (B, 1) one, as linear_logprobs takes them.
    hidden, target = x["hidden"].reshape(4, 6, 8), x["target"].reshape(4, 6)
    for temperature in (0.7, T.reshape(4, 6)[:, :1].clone()):
        want = torch_fce.linear_logprobs(hidden, x["weight"], target, x["bias"],
                                         temperature=temperature, entropy=True)
        got = vocab_parallel_linear_logprobs(
            hidden, x["weight"][start:end], target, x["bias"][start:end], vocab_start=start,
            vocab_size=V, temperature=temperature, entropy=True)
        assert rel_err(got.logprob, want.logprob) <= LOSS_TOL
        assert rel_err(got.entropy, want.entropy) <= LOSS_TOL

    # Confident rows at large magnitudes: as close to float64 as torch's float32
    # log_softmax (docs/numerics.md), as on one device.
    c = confident_inputs(24, 8, V)
    Vs = SPLITS[world][rank + 1] - start
    ref64, ref32 = (confident_grads(logprob_composition(c[2]), dt, c)
                    for dt in (torch.float64, torch.float32))
    with torch_fce.workspace(3 * -(-V // world) * 4):
        got = confident_grads(lambda h, w: vocab_parallel_linear_logprobs(
            h, w.narrow(0, start, Vs), c[2], vocab_start=start, vocab_size=V,
            entropy=True)[:2], torch.float32, c)
    assert rel_err(got[0], ref64[0]) <= 2 * rel_err(ref32[0], ref64[0]) + 1e-7
    assert rel_err(got[1][start:end], ref64[1][start:end]) <= \
        2 * rel_err(ref32[1][start:end], ref64[1][start:end]) + 1e-7

    mesh = init_device_mesh("cpu", (world,))
    h = x["hidden"].clone().requires_grad_()
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(x["bias"], mesh, [Shard(0)]).requires_grad_()
    out, grads = run(lambda l: torch_fce.linear_logprobs(
        l["h"], l["w"], x["target"], l["b"], **opts), {"h": h, "w": w, "b": b})
    assert rel_err(out.logprob, ref.logprob) <= LOSS_TOL
    assert rel_err(grads[0], ref_grads[0]) <= tol
    assert rel_err(grads[1].full_tensor(), ref_grads[1]) <= tol


def _check_logprob_edges(rank, world):
    # A NaN logit (class 20) is never the argmax, and a shard whose logits are all -inf
    # (by its bias: all but rank 0's) adds nothing to a row whose max passes 1e31: entropy 0, finite
    # gradients, as on one process.
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    w = torch.zeros(V, 1)
    w[1], w[20] = 10.0, float("nan")
    h, t = torch.ones(2, 1), torch.zeros(2, dtype=torch.long)
    got = vocab_parallel_linear_logprobs(h, w[start:end], t, vocab_start=start, vocab_size=V)
    assert got.argmax.tolist() == [1, 1]
    w, b = torch.zeros(V, 1), torch.full((V,), float("-inf"))
    w[:2, 0], b[:4] = torch.tensor([2.0, 1.0]), 0.0
    leaves = (h.requires_grad_(), w[start:end].clone().requires_grad_(),
              b[start:end].clone().requires_grad_())
    out = vocab_parallel_linear_logprobs(leaves[0], leaves[1], t, leaves[2],
                                         vocab_start=start, vocab_size=V,
                                         temperature=1e-31, entropy=True)
    assert out.entropy.tolist() == [0.0, 0.0] and out.logprob.tolist() == [0.0, 0.0]
    grads = torch.autograd.grad((out.logprob + out.entropy).sum(), leaves)
    assert all(g.isfinite().all() for g in grads)


def _check_policy_loss(rank, world):
    # linear_policy_loss over uneven shards and many chunks (3-row workspace), for each
    # loss type, and through a Shard(0) DTensor weight, against one process: the loss,
    # every statistic and the gradients; ranks agree bitwise.
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    x = make_inputs(24, 8, V, ignore_frac=0.2, bias=True, seed=13, weight_scale=2.0)
    g = torch.Generator().manual_seed(7)
    target = x["target"].reshape(4, 6)
    with torch.no_grad():
        lp = torch_fce.linear_logprobs(x["hidden"].reshape(4, 6, 8), x["weight"], target,
                                       x["bias"], temperature=0.7).logprob
    opts = dict(old_logprobs=lp + 0.3 * torch.randn(4, 6, generator=g),
                ref_logprobs=lp + 0.1, beta=0.04, entropy_coef=0.01, temperature=0.7,
                softcap=4.0, epsilon_high=0.28)
    advantages = torch.randn(4, generator=g)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]

    def run(weight, bias, fn, **extra):
        h = x["hidden"].reshape(4, 6, 8).clone().requires_grad_()
        loss, stats = fn(h, weight, target, advantages, bias, **opts, **extra)
        grads = torch.autograd.grad(loss * 0.5, [h, weight, bias])
        return loss, stats, grads

    wants = {}
    from torch_fce.ops.linear_policy_loss import LOSS_TYPES

    for loss_type in LOSS_TYPES:
        full = [x[k].clone().requires_grad_() for k in ("weight", "bias")]
        want = wants[loss_type] = run(*full, torch_fce.linear_policy_loss, loss_type=loss_type)
        mine = [x[k][start:end].clone().requires_grad_() for k in ("weight", "bias")]
        with torch_fce.workspace(3 * -(-V // world) * 4):
            got = run(*mine, vocab_parallel_linear_policy_loss, vocab_start=start,
                      vocab_size=V, loss_type=loss_type)
        assert rel_err(got[0], want[0]) <= LOSS_TOL, loss_type
        for a, b in zip(got[1], want[1]):
            assert rel_err(a, b) <= LOSS_TOL, loss_type
        tol = grad_tol(torch.float32, V)
        assert rel_err(got[2][0], want[2][0]) <= tol, loss_type
        assert rel_err(got[2][1], want[2][1][start:end]) <= tol, loss_type
        assert rel_err(got[2][2], want[2][2][start:end]) <= tol, loss_type
        losses = [torch.empty(()) for _ in range(world)]
        dist.all_gather(losses, got[0].detach())
        assert all(torch.equal(t, losses[0]) for t in losses)

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(x["bias"], mesh, [Shard(0)]).requires_grad_()
    got, want = run(w, b, torch_fce.linear_policy_loss), wants["clip"]
    assert rel_err(got[0], want[0]) <= LOSS_TOL
    assert rel_err(got[2][1].full_tensor(), want[2][1]) <= grad_tol(torch.float32, V)


def _check_distillation(rank, world):
    # linear_distillation_loss over uneven shards of both heads and many chunks (3-row
    # workspace), per beta with every option, without a target, and through Shard(0)
    # DTensor heads, against one process: the loss, both statistics, the gradients.
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    x = make_inputs(24, 8, V, ignore_frac=0.2, bias=True, seed=17, weight_scale=2.0)
    t = make_inputs(24, 12, V, bias=True, seed=18, weight_scale=2.0)
    g = torch.Generator().manual_seed(5)
    T = torch.rand(24, generator=g) + 0.5
    tw = torch.rand(24, generator=g)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    cases = [dict(beta=0.0, hard_weight=0.3, temperature=T, token_weights=tw),
             dict(beta=0.5, softcap=5.0, teacher_softcap=7.0, logit_scale=0.8,
                  temperature=0.9, hard_weight=0.2),
             dict(beta=1.0, teacher_logit_scale=1.3), dict(beta=0.3, target=None)]

    def run(fn, weight, bias, tw_, tb, opts, **extra):
        opts = dict(opts)
        target = opts.pop("target", x["target"])
        h = x["hidden"].clone().requires_grad_()
        loss, stats = fn(h, weight, t["hidden"], tw_, target, bias, tb, **opts, **extra)
        return loss, stats, torch.autograd.grad(loss * 0.5, [h, weight, bias])

    for opts in cases:
        full = [x[k].clone().requires_grad_() for k in ("weight", "bias")]
        want = run(torch_fce.linear_distillation_loss, full[0], full[1], t["weight"],
                   t["bias"], opts)
        mine = [x[k][start:end].clone().requires_grad_() for k in ("weight", "bias")]
        with torch_fce.workspace(3 * -(-V // world) * 4 * 10):
            got = run(vocab_parallel_linear_distillation_loss, mine[0], mine[1],
                      t["weight"][start:end], t["bias"][start:end], opts,
                      vocab_start=start, vocab_size=V)
        name = str(sorted(opts))
        assert rel_err(got[0], want[0]) <= LOSS_TOL, name
        for a, b in zip(got[1], want[1]):
            assert rel_err(a, b) <= LOSS_TOL, name
        tol = grad_tol(torch.float32, V)
        assert rel_err(got[2][0], want[2][0]) <= tol, name
        assert rel_err(got[2][1], want[2][1][start:end]) <= tol, name
        assert rel_err(got[2][2], want[2][2][start:end]) <= tol, name

    mesh = init_device_mesh("cpu", (world,))
    w, b, w_t, b_t = (distribute_tensor(v, mesh, [Shard(0)]) for v in
                      (x["weight"], x["bias"], t["weight"], t["bias"]))
    w.requires_grad_()
    b.requires_grad_()
    full = [x[k].clone().requires_grad_() for k in ("weight", "bias")]
    want = run(torch_fce.linear_distillation_loss, *full, t["weight"], t["bias"], cases[1])
    got = run(torch_fce.linear_distillation_loss, w, b, w_t, b_t, cases[1])
    assert rel_err(got[0], want[0]) <= LOSS_TOL
    assert rel_err(got[2][1].full_tensor(), want[2][1]) <= grad_tol(torch.float32, V)
    with pytest.raises(ValueError, match="teacher_weight must be a DTensor"):
        run(torch_fce.linear_distillation_loss, w, b, t["weight"], None, cases[2])


# the sparse ops on the PyTorch rows, and on the Triton kernels over the four uneven
# shards, one narrower than the top-k's k (the interpreter, slow: these ranks' tensors
# are the CPU's; on CUDA tests/distributed/test_vocab_parallel_nccl.py runs them)
_ROWS = {2: (False,), 4: (False, True) if os.environ.get("TRITON_INTERPRET") == "1"
         else (False,)}


@contextlib.contextmanager
def _triton_rows(on):
    """Every op on the Triton row kernels (the interpreter on the CPU), as on CUDA, one
    device and shards alike; on=False: as the device picks them."""
    if not on:
        yield
        return
    with mock.patch.object(dispatch, "backend_for", lambda hidden: TRITON):
        yield


def _check_sparse(rank, world):
    # linear_sparse_divergence (every beta, tail on and off, invalid entries, options)
    # and linear_soft_cross_entropy over uneven shards and many chunks, and through a
    # Shard(0) DTensor weight, against one process: the loss, the statistics, the
    # gradients (the weight's and bias's: this rank's rows); on the PyTorch rows and on
    # the Triton kernels (each against its own one device).
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    x = make_inputs(24, 8, V, bias=True, seed=21, weight_scale=2.0)
    g = torch.Generator().manual_seed(6)
    support = torch.randint(0, V, (24, 5), generator=g)
    support[3, 1] = -100
    support[5] = -100  # a token without valid entries
    support[support == 11] = 12
    x["bias"][11] = -math.inf  # a -inf logit off the support (softcap: -cap, counted apart)
    lp = torch.randn(24, 5, generator=g).log_softmax(-1) - 0.2
    lp[7, 2] = float("-inf")
    probs = torch.rand(24, 5, generator=g)
    T, tw = torch.rand(24, generator=g) + 0.5, torch.rand(24, generator=g)
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    cases = [(torch_fce.linear_sparse_divergence, vocab_parallel_linear_sparse_divergence,
              lp, opts) for opts in (
        dict(beta=0.0, tail=True, temperature=T), dict(beta=0.4, token_weights=tw),
        dict(beta=1.0, tail=True, softcap=4.0, logit_scale=0.8))] + [
        (torch_fce.linear_soft_cross_entropy, vocab_parallel_linear_soft_cross_entropy,
         probs, dict(temperature=0.8, token_weights=tw))]

    def run(fn, weight, bias, values, opts, **extra):
        h = x["hidden"].clone().requires_grad_()
        out = fn(h, weight, support, values, bias, **opts, **extra)
        loss, stats = out if isinstance(out, tuple) else (out, ())
        return loss, stats, torch.autograd.grad(loss * 0.5, [h, weight, bias])

    tol = grad_tol(torch.float32, V)
    for (one, parallel, values, opts), triton_rows in itertools.product(cases, _ROWS[world]):
        if triton_rows and opts.get("beta") == 1.0:  # the kernels: the tail, no tail and
            continue  # soft cross entropy cases (softcap and logit_scale: the top-k's)
        full = [x[k].clone().requires_grad_() for k in ("weight", "bias")]
        mine = [x[k][start:end].clone().requires_grad_() for k in ("weight", "bias")]
        with _triton_rows(triton_rows):
            want = run(one, *full, values, opts)
            with torch_fce.workspace(3 * -(-V // world) * 4 * 10):
                got = run(parallel, *mine, values, opts, vocab_start=start, vocab_size=V)
        name = f"{one.__name__} {sorted(opts)}, Triton rows {triton_rows}"
        assert rel_err(got[0], want[0]) <= LOSS_TOL, name
        for a, b in zip(got[1], want[1]):
            assert rel_err(a, b) <= LOSS_TOL, name
        assert rel_err(got[2][0], want[2][0]) <= tol, name
        assert rel_err(got[2][1], want[2][1][start:end]) <= tol, name
        assert rel_err(got[2][2], want[2][2][start:end]) <= tol, name

    mesh = init_device_mesh("cpu", (world,))
    w, b = (distribute_tensor(v, mesh, [Shard(0)]).requires_grad_() for v in
            (x["weight"], x["bias"]))
    full = [x[k].clone().requires_grad_() for k in ("weight", "bias")]
    for one, _, values, opts in cases[1:]:
        want = run(one, *full, values, opts)
        got = run(one, w, b, values, opts)
        assert rel_err(got[0], want[0]) <= LOSS_TOL
        assert rel_err(got[2][1].full_tensor(), want[2][1]) <= tol


def _exact(x):
    """Inputs on a grid of 1/8 (D = 8): every logit exact, so equal head rows give equal
    logits whatever blocking a GEMM of either shape picks (ties stay ties)."""
    return {k: v if v is None or not v.is_floating_point() else (v * 8).round() / 8
            for k, v in x.items()}


def _check_topk(rank, world):
    # linear_topk_logprobs over uneven shards (one narrower than k), many chunks, ties
    # straddling shards (repeated head rows), and through a Shard(0) DTensor head,
    # against one process: the same classes in the same order, the same log-probs; on
    # the PyTorch rows and on the Triton kernels (each against its own one device).
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    x = _exact(make_inputs(24, 8, V, bias=True, seed=23, weight_scale=2.0))
    w, b = x["weight"].clone(), x["bias"].clone()
    w[20:30], b[20:30] = w[0:10], b[0:10]  # equal logits in different shards
    start, end = SPLITS[world][rank], SPLITS[world][rank + 1]
    target = x["target"]
    target[3] = 20  # a class tied with another shard's
    for triton_rows in _ROWS[world]:
        for opts in (dict(temperature=0.8), dict(softcap=4.0, logit_scale=0.7,
                                                 temperature=0.9, target=target)
                     )[triton_rows:]:  # the kernels: the second (its options hold the first's)
            with _triton_rows(triton_rows):
                want = torch_fce.linear_topk_logprobs(x["hidden"], w, 6, b, **opts)
                with torch_fce.workspace(3 * -(-V // world) * 4 * 12):
                    got = vocab_parallel_linear_topk_logprobs(
                        x["hidden"], w[start:end], 6, b[start:end], vocab_start=start,
                        vocab_size=V, **opts)
            name = f"{opts}, Triton rows {triton_rows}"
            assert torch.equal(got.indices, want.indices), name
            assert rel_err(got.logprobs, want.logprobs) <= LOSS_TOL, name
            if "target" in opts:
                assert rel_err(got.target_logprob, want.target_logprob) <= LOSS_TOL, name
    mesh = init_device_mesh("cpu", (world,))
    got = torch_fce.linear_topk_logprobs(x["hidden"], distribute_tensor(w, mesh, [Shard(0)]),
                                         6, distribute_tensor(b, mesh, [Shard(0)]),
                                         target=target)
    want = torch_fce.linear_topk_logprobs(x["hidden"], w, 6, b, target=target)
    assert torch.equal(got.indices, want.indices)
    assert rel_err(got.target_logprob, want.target_logprob) <= LOSS_TOL


def _check_truncation(rank, world):
    # the sampler's truncation vocab-parallel against one process: top_k among the shards'
    # candidates, and top_p / min_p without one (and a top_k over 256 classes) by the
    # search of values; ties straddling shards, many chunks; log-probs (-inf at the same
    # tokens), entropy, gradients; through a Shard(0) DTensor head; the policy loss
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    g = torch.Generator().manual_seed(7)
    mesh = init_device_mesh("cpu", (world,))
    for vocab, opts in ((V, dict(top_k=7, top_p=0.8, min_p=0.02)), (V, dict(top_p=0.8)),
                        (V, dict(min_p=0.05)), (V, dict(top_p=0.9, min_p=0.02, top_k=V)),
                        (301, dict(top_k=260, top_p=0.95)), (301, dict(top_k=270))):
        x = _exact(make_inputs(24, 8, vocab, bias=True, seed=29, weight_scale=2.0))
        w, b = x["weight"].clone(), x["bias"].clone()
        w[20:30], b[20:30] = w[0:10], b[0:10]  # equal logits in different shards
        x["hidden"][3] = 0.0  # a row of equal logits but the bias'
        splits = SPLITS[world] if vocab == V else [vocab * r // world for r in range(world + 1)]
        start, end = splits[rank], splits[rank + 1]
        target = x["target"].clone()
        target[:8] = (x["hidden"][:8] @ w.T + b).argmax(-1)  # kept
        opts = dict(opts, temperature=0.8, entropy=True)
        cl, ce = torch.randn(24, generator=g), torch.randn(24, generator=g)

        def run(fn, weight, bias, **extra):
            leaves = [t.clone().requires_grad_() for t in (x["hidden"], weight, bias)]
            out = fn(*leaves[:2], target, leaves[2], **opts, **extra)
            lp = torch.where(out.logprob > -math.inf, out.logprob, 0.0)
            return out, torch.autograd.grad((lp * cl + out.entropy * ce).sum(), leaves)

        # also on the Triton rows (the shards' own top-k merged, the search's tally a
        # sweep), against their own one device
        for triton_rows in _ROWS[world]:
            with _triton_rows(triton_rows):
                want, want_g = run(torch_fce.linear_logprobs, w, b)
                with torch_fce.workspace(3 * -(-vocab // world) * 4 * 12):
                    got, got_g = run(vocab_parallel_linear_logprobs, w[start:end],
                                     b[start:end], vocab_start=start, vocab_size=vocab)
            name = (opts, triton_rows)
            assert (want.logprob == -math.inf).any() and (want.logprob > -math.inf).any()
            assert torch.equal(got.logprob == -math.inf, want.logprob == -math.inf), name
            for a, r in ((got.logprob, want.logprob), (got.entropy, want.entropy)):
                assert rel_err(torch.where(r > -math.inf, a, 0.0),
                               torch.where(r > -math.inf, r, 0.0)) <= LOSS_TOL, name
            for a, r in zip(got_g, (want_g[0], want_g[1][start:end], want_g[2][start:end])):
                assert rel_err(a, r) <= grad_tol(torch.float32, vocab), name
        if vocab != V:
            continue
        dt = torch_fce.linear_logprobs(x["hidden"], distribute_tensor(w, mesh, [Shard(0)]),
                                       target, distribute_tensor(b, mesh, [Shard(0)]), **opts)
        assert torch.equal(dt.logprob == -math.inf, want.logprob == -math.inf), opts
        A = torch.randn(24, generator=g)
        old = torch.where(want.logprob > -math.inf, want.logprob, -5.0).detach() + 0.1
        policy = dict(opts, entropy_coef=0.01, old_logprobs=old)
        policy.pop("entropy")
        losses = []
        for fn, weight, bias, extra in (
                (torch_fce.linear_policy_loss, w, b, {}),
                (vocab_parallel_linear_policy_loss, w[start:end], b[start:end],
                 dict(vocab_start=start, vocab_size=V))):
            leaves = [t.clone().requires_grad_() for t in (x["hidden"], weight, bias)]
            loss, _ = fn(leaves[0], leaves[1], target, A, leaves[2], **policy, **extra)
            losses.append((loss, *torch.autograd.grad(loss, leaves)))
        (l1, *g1), (l0, *g0) = losses[1], losses[0]
        assert rel_err(l1, l0) <= LOSS_TOL, opts
        for a, r in zip(g1, (g0[0], g0[1][start:end], g0[2][start:end])):
            assert rel_err(a, r) <= grad_tol(torch.float32, V), opts


def _check_verl(rank, world):
    # verl's call with its tensor-parallel group: equal contiguous shards, the same
    # values and gradients as one process.
    from torch_fce.integrations.verl import linear_cross_entropy

    local = 13
    x = make_inputs(12, 8, local * world, ignore_frac=0.2, seed=11, weight_scale=2.0)
    g = torch.Generator().manual_seed(4)
    gl, ge = torch.randn(12, generator=g), torch.randn(12, generator=g)
    outs = []
    for w, group in ((x["weight"], None),
                     (x["weight"][rank * local:(rank + 1) * local], dist.group.WORLD)):
        h, w = x["hidden"].clone().requires_grad_(), w.clone().requires_grad_()
        # Megatron's layout: hidden (s, 1, D), labels (1, s)
        lp, ent = linear_cross_entropy(h[:, None], w, x["target"][None], 0.7, "none", group)
        outs.append((lp, ent, *torch.autograd.grad((lp * gl + ent * ge).sum(), (h, w))))
    (lp, ent, dh, dw), (lp1, ent1, dh1, dw1) = outs
    assert rel_err(lp1, lp) <= LOSS_TOL and rel_err(ent1, ent) <= LOSS_TOL
    assert rel_err(dh1, dh) <= grad_tol(torch.float32, local * world)
    assert rel_err(dw1, dw[rank * local:(rank + 1) * local]) <= grad_tol(torch.float32,
                                                                       local * world)


def _worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for family in FAMILIES:
            _check_family(rank, world, family)
        _check_uneven_shards_over_many_chunks(rank, world)
        _check_out_of_range_target(rank, world)
        if world == 2:  # torch.compile, verl and FSDP2 on the op as on any group: 2 ranks
            _check_compiled(rank, world)
            _check_verl(rank, world)
            _check_fsdp2(rank, world)
        _check_frozen_weight_and_no_grad(rank, world)
        _check_dtensor(world)
        _check_logprobs(rank, world)
        _check_logprob_edges(rank, world)
        _check_policy_loss(rank, world)
        _check_distillation(rank, world)
        _check_sparse(rank, world)
        _check_topk(rank, world)
        _check_truncation(rank, world)
        # Shards that do not tile V: every rank raises the same clear error, none hangs.
        w = torch.randn(10, 8)
        with pytest.raises(ValueError, match="do not tile"):
            vocab_parallel_linear_cross_entropy(torch.randn(4, 8), w, torch.zeros(4).long(),
                                                vocab_start=0, vocab_size=20)
        n = 4 + rank  # different token counts across ranks
        with pytest.raises(ValueError, match="differ across ranks"):
            vocab_parallel_linear_cross_entropy(torch.randn(n, 8), w, torch.zeros(n).long(),
                                                vocab_start=10 * rank, vocab_size=10 * world)
    finally:
        dist.destroy_process_group()
    # Passed. Leave without C++ static destructors: about one run in 20 here, a torch
    # background thread still joinable at interpreter exit aborts the process (SIGABRT,
    # "terminate called without an active exception") after every check has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_single_process(world):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store")), nprocs=world, join=True)


def test_vocab_parallel_rejects_bad_class_weight_before_any_collective():
    # Raised on every rank alike (class_weight is replicated), before the tiling
    # all-gather: so no process group is needed here.
    x = make_inputs(4, 8, V)
    args = (x["hidden"], x["weight"][:10], x["target"])
    for cw, error, message in ((torch.ones(V, dtype=torch.int64), TypeError, "floating"),
                               (torch.ones(V - 1), ValueError, "vocab_size"),
                               (torch.ones(V, device="meta"), ValueError, "is on meta")):
        with pytest.raises(error, match=message):
            vocab_parallel_linear_cross_entropy(*args, class_weight=cw, vocab_start=0,
                                                vocab_size=V)

"""The methods the benchmarks compare, torch_fce's and its peers', one step of any, and
the materialised reference they are measured against."""

import contextlib
import sys

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench import rl
from torch_fce.bench.measure import backend, compiled, with_context, with_workspace
from torch_fce.ops.machinery.dispatch import exp_on_cuda


def _torch_unfused(h, w, t):
    # As HF: logits in the input dtype, upcast to float32 for the loss.
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def _fce(accumulator, logits_dtype=None):
    return lambda h, w, t: torch_fce.linear_cross_entropy(h, w, t, accumulator=accumulator,
                                                          logits_dtype=logits_dtype)


def _liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda h, w, t: loss(w, h, t)


def _cce(impl=None):
    from cut_cross_entropy import linear_cross_entropy

    kw = {} if impl is None else dict(impl=impl)
    return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=-100, **kw)


def _quack(chunk, fused):
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    # use_scaled_exp: True is quack's fused SM90 pipeline, False its base one (None would
    # pick per shape, so both are named explicitly).
    return lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk, ignore_index=-100,
                                                        use_scaled_exp=fused)


# The time-memory sweep (--sweep): torch_fce's workspace and the peers' chunk sizes.
SWEEP_WORKSPACE_MIB = (256, 512, 1024, 2048, 4096)


QUACK_CHUNKS = (4096, 8192)


def _peers():
    """Peer name -> factory; factories raise where the peer is missing or cannot load."""
    out = {"liger": _liger, "cce": _cce, "cce-exact": lambda: _cce("cce_exact")}
    for chunk in QUACK_CHUNKS:
        for fused, label in ((False, "base"), (True, "fused")):
            out[f"quack-{label}-{chunk}"] = lambda c=chunk, f=fused: _quack(c, f)
    return out


def methods(device, with_compile, sweep=()):
    """Name -> loss function (hidden, weight, target) for every method available here.

    Peers (CUDA, where installed): Liger, CCE (default and cce_exact) and quack (base and
    fused pipelines at each chunk of QUACK_CHUNKS). sweep (workspaces in MiB) adds
    torch_fce fp32 at each ("fce-fp32@MiB"). "fce-f32logits": fp32 with
    logits_dtype=torch.float32. "fce-exp": the exp-GEMM pipeline (TORCH_FCE_BACKEND=exp,
    docs/api.md), where it runs: an sm_90 GPU with quack-kernels.
    """
    out = {"torch": _torch_unfused}
    if with_compile:
        out.update(compiled(_torch_unfused))
    if device == "cuda":
        for name, make in _peers().items():
            try:
                out[name] = make()
            except Exception as e:  # missing, or installed without its runtime
                print(f"  {name} unavailable: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    for acc in ("fp32", "kahan", "input"):
        out[f"fce-{acc}"] = _fce(acc)
    out["fce-f32logits"] = _fce("fp32", torch.float32)
    if device == "cuda" and exp_on_cuda(torch.cuda.current_device()):
        out["fce-exp"] = with_context(_fce("fp32"), lambda: backend("exp"))
    for mib in sweep:
        out[f"fce-fp32@{mib}"] = with_workspace(_fce("fp32"), mib)
    return out


def reference(x, dtype=torch.float32, objective="ce"):
    """Loss and gradients in dtype from the same (rounded) inputs, logits materialised."""
    h = x["hidden"].to(dtype).requires_grad_()
    w = x["weight"].to(dtype).requires_grad_()
    if objective == "logprobs":
        loss = rl.logprobs_unfused(h, w, x["target"])
    elif objective == "policy":
        loss = rl.policy_unfused(h, w, x["target"], *x["data"])
    else:
        loss = F.cross_entropy(F.linear(h, w), x["target"], ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def run_step(fn, x):
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    with getattr(fn, "context", contextlib.nullcontext)():  # measure.with_context
        loss = fn(h, w, x["target"], *x.get("data", ()))
        loss.backward()
    return loss.detach(), h.grad, w.grad

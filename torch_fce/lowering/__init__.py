"""Automatic fusion of linear + cross_entropy in torch.compile'd (Inductor) models.

    torch_fce.lowering.enable()          # every later Inductor compile
    with torch_fce.lowering.auto_fuse(): # or just inside this block
        loss = torch.compile(model)(batch)

The pass runs before autograd, so the fused op's own autograd serves training. It only
exists for the Inductor backend; elsewhere models simply run unfused. What it did is
counted in torch._dynamo.utils.counters["inductor"]["fce_linear_ce_fused"] and, per
reason, counters["fce_linear_ce_skipped"]; the logger torch_fce.lowering says more. A
cross entropy left unfused because its logits have another use (a model that returns
them) raises an UnfusedWarning naming the remedy, once per compiled graph.
"""

import contextlib
import warnings

import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..extension import check_options
from .graph_pass import FUSED, SKIPPED, FuseLinearCrossEntropy, UnfusedWarning

__all__ = ["enable", "disable", "auto_fuse", "fresh_compiles", "installed", "Chain", "FUSED",
           "SKIPPED", "UnfusedWarning"]

_PASS = FuseLinearCrossEntropy()


class Chain(CustomGraphPass):
    """Pre-grad passes run in order, as one pass: Inductor takes a single callable
    (torch 2.11 calls the config's value; only later versions also take a tuple)."""

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph):
        for p in self.passes:
            p(graph)

    def uuid(self):
        # None (Inductor then bypasses its caches) unless every pass names its own
        # version: a pass that does not would otherwise be keyed on its address or "None".
        keys = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if any(k is None for k in keys) else "|".join(map(str, keys))


def installed():
    """The pre-grad passes Inductor runs now, in order."""
    current = inductor_config.pre_grad_custom_pass
    if current is None:
        return ()
    if isinstance(current, Chain):
        return current.passes
    return tuple(current) if isinstance(current, (list, tuple)) else (current,)


def _install(passes):
    inductor_config.pre_grad_custom_pass = None if not passes else passes[0] \
        if len(passes) == 1 else Chain(passes)


def enable(accumulator="fp32"):
    """Adds the pass after any pre-grad pass already installed (idempotent); the fused
    ops it inserts use `accumulator` (see docs/api.md)."""
    check_options("linear_cross_entropy", accumulator=accumulator)
    _PASS.accumulator = accumulator
    passes = installed()
    if _PASS not in passes:
        _install(passes + (_PASS,))


def disable():
    """Removes the pass, leaving any other installed pass in place."""
    _install(tuple(p for p in installed() if p is not _PASS))


@contextlib.contextmanager
def auto_fuse(accumulator="fp32"):
    """Enables the pass inside the block (compiles that happen there), restores after.

    torch.compile compiles at the compiled function's first call: a block inside which
    nothing compiled warns, since the pass then ran on nothing."""
    was, was_accumulator = inductor_config.pre_grad_custom_pass, _PASS.accumulator
    compiled = counters["stats"]["unique_graphs"]
    enable(accumulator)
    try:
        yield
    finally:
        inductor_config.pre_grad_custom_pass = was
        _PASS.accumulator = was_accumulator
    if counters["stats"]["unique_graphs"] == compiled:
        warnings.warn("torch_fce.lowering.auto_fuse(): nothing was compiled inside the "
                      "block, so the pass fused nothing. torch.compile compiles at the "
                      "compiled function's first call (and reuses what it compiled before "
                      "for the same code until torch._dynamo.reset()): make that first "
                      "call inside the block, or use torch_fce.lowering.enable()",
                      UserWarning, stacklevel=3)


@contextlib.contextmanager
def fresh_compiles():
    """Compiles inside the block skip Inductor's FX-graph and AOTAutograd caches, so the
    pass runs and the counters count it (a cache hit loads the fused graph uncounted)."""
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield

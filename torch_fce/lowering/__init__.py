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

import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from ..ops.checks import check_options
from .graph_pass import FUSED, SKIPPED, FuseLinearCrossEntropy, UnfusedWarning

__all__ = ["enable", "disable", "auto_fuse", "fresh_compiles", "FUSED", "SKIPPED",
           "UnfusedWarning"]

_PASS = FuseLinearCrossEntropy()


def _installed():
    current = inductor_config.pre_grad_custom_pass
    if current is None:
        return ()
    return tuple(current) if isinstance(current, (list, tuple)) else (current,)


def enable(accumulator="fp32"):
    """Adds the pass after any pre-grad pass already installed (idempotent); the fused
    ops it inserts use `accumulator` (see docs/api.md)."""
    check_options("mean", 0.0, None, 0.0, accumulator)
    _PASS.accumulator = accumulator
    passes = _installed()
    if _PASS not in passes:
        inductor_config.pre_grad_custom_pass = passes + (_PASS,) if passes else _PASS


def disable():
    """Removes the pass, leaving any other installed pass in place."""
    rest = tuple(p for p in _installed() if p is not _PASS)
    inductor_config.pre_grad_custom_pass = None if not rest else rest[0] if len(rest) == 1 \
        else rest


@contextlib.contextmanager
def auto_fuse(accumulator="fp32"):
    """Enables the pass inside the block (compiles that happen there), restores after."""
    was, was_accumulator = inductor_config.pre_grad_custom_pass, _PASS.accumulator
    enable(accumulator)
    try:
        yield
    finally:
        inductor_config.pre_grad_custom_pass = was
        _PASS.accumulator = was_accumulator


@contextlib.contextmanager
def fresh_compiles():
    """Compiles inside the block skip Inductor's FX-graph and AOTAutograd caches, so the
    pass runs and the counters count it (a cache hit loads the fused graph uncounted)."""
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield

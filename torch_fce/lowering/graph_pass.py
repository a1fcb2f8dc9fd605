"""The Inductor pre-grad pass that rewrites linear + cross_entropy into fce::linear_ce."""

import logging
import operator
import os
import warnings

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .patterns import CROSS_ENTROPY, OTHER_USE, NoMatch, match

log = logging.getLogger(__name__)
FUSED = "fce_linear_ce_fused"  # counters["inductor"][FUSED]: rewrites done
SKIPPED = "fce_linear_ce_skipped"  # counters[SKIPPED][reason]: cross entropies left alone


_OTHER_USE_ADVICE = (
    "torch_fce.lowering left a cross entropy unfused: the logits have another use (the "
    "model returns them, or other code reads them), so fusing could not drop them and "
    "this step's memory is unchanged. For transformers models call "
    "torch_fce.integrations.transformers.apply(model) before torch.compile: in training "
    "with labels it returns no logits (docs/lowering.md has the measured saving).")


class UnfusedWarning(UserWarning):
    """A cross entropy the lowering pass could have fused but for the user's code."""


class FuseLinearCrossEntropy(CustomGraphPass):
    """Replaces F.cross_entropy(linear(x, W, b)...) by torch.ops.fce.linear_ce."""

    def __init__(self, accumulator="fp32"):
        self.accumulator = accumulator  # of the inserted ops

    def __call__(self, graph):
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in CROSS_ENTROPY:
                try:
                    m = match(node)
                except Exception as reason:  # NoMatch, or a graph the matcher cannot read
                    why = str(reason) if isinstance(reason, NoMatch) else \
                        f"unreadable graph ({type(reason).__name__}: {reason})"
                    counters[SKIPPED][why] += 1
                    log.info("fce lowering: left %s unfused: %s", node.name, why)
                    if why == OTHER_USE:
                        warnings.warn(UnfusedWarning(_OTHER_USE_ADVICE), stacklevel=2)
                    continue
                _rewrite(graph, m, self.accumulator)
                counters["inductor"][FUSED] += 1
                log.info("fce lowering: fused %s into fce::linear_ce", node.name)

    def uuid(self):
        here = os.path.dirname(__file__)
        files = tuple(os.path.join(here, f) for f in ("graph_pass.py", "patterns.py"))
        return get_hash_for_files(files, extra=self.accumulator)


def _rewrite(graph, m, accumulator):
    with graph.inserting_before(m.cross_entropy):
        hidden, weight, bias = m.hidden, m.weight, m.bias
        if m.vocab_rows is not None:  # a padded head: the first V rows
            rows = slice(None, m.vocab_rows, None)
            weight = graph.call_function(operator.getitem, (weight, rows))
            if bias is not None:
                bias = graph.call_function(operator.getitem, (bias, rows))
        for index in m.leading_slices:  # slices of the logits' leading dims, on hidden
            hidden = graph.call_function(operator.getitem, (hidden, index))
        hidden = graph.call_method("flatten", (hidden, 0, -2))
        target = graph.call_method("reshape", (m.target, -1))
        fused = graph.call_function(
            torch.ops.fce.linear_ce.default,
            (hidden, weight, target, bias, m.class_weight),
            dict(m.options, accumulator=accumulator))
        if m.loss_dtype != torch.float32:  # e.g. bf16 logits without an upcast
            fused = graph.call_method("to", (fused, m.loss_dtype))
    m.cross_entropy.replace_all_uses_with(fused)
    graph.erase_node(m.cross_entropy)
    for node in m.chain:  # consumer first, so each is unused when erased
        if not node.users:
            graph.erase_node(node)

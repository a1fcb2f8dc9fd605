"""docs/api.md lists the signatures the code has."""

import inspect
import pathlib

import torch

import torch_fce
import torch_fce.lowering
from torch_fce.distributed import (vocab_parallel_linear_cross_entropy,
                                   vocab_parallel_linear_distillation_loss,
                                   vocab_parallel_linear_policy_loss,
                                   vocab_parallel_linear_soft_cross_entropy,
                                   vocab_parallel_linear_sparse_divergence,
                                   vocab_parallel_linear_topk_logprobs)
from torch_fce.integrations import transformers as fce_hf
from torch_fce.integrations import trl as fce_trl
from torch_fce.integrations import verl as fce_verl

API = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def _sig(name, fn):
    return name + str(inspect.signature(fn)).replace("(self, ", "(")


def test_docs_api_schema_matches_the_registered_op():
    for op in (torch.ops.fce.linear_ce, torch.ops.fce.linear_ce_stats,
               torch.ops.fce.linear_logprobs, torch.ops.fce.linear_policy_loss,
               torch.ops.fce.linear_distillation_loss,
               torch.ops.fce.linear_soft_cross_entropy, torch.ops.fce.linear_topk_logprobs,
               torch.ops.fce.linear_sparse_divergence):
        assert str(op.default._schema) in API


def test_docs_api_python_signatures_match():
    for name, fn in {
        "torch_fce.linear_cross_entropy": torch_fce.linear_cross_entropy,
        "torch_fce.linear_logprobs": torch_fce.linear_logprobs,
        "torch_fce.linear_policy_loss": torch_fce.linear_policy_loss,
        "torch_fce.linear_distillation_loss": torch_fce.linear_distillation_loss,
        "torch_fce.linear_soft_cross_entropy": torch_fce.linear_soft_cross_entropy,
        "torch_fce.linear_topk_logprobs": torch_fce.linear_topk_logprobs,
        "torch_fce.linear_sparse_divergence": torch_fce.linear_sparse_divergence,
        "torch_fce.set_workspace": torch_fce.set_workspace,
        "torch_fce.workspace": torch_fce.workspace,
        "torch_fce.integrations.trl.per_token_logps_and_entropies":
            fce_trl.per_token_logps_and_entropies,
        "torch_fce.LinearCrossEntropyLoss": torch_fce.LinearCrossEntropyLoss.__init__,
        "torch_fce.lowering.enable": torch_fce.lowering.enable,
        "torch_fce.lowering.disable": torch_fce.lowering.disable,
        "torch_fce.lowering.auto_fuse": torch_fce.lowering.auto_fuse,
        "torch_fce.lowering.fresh_compiles": torch_fce.lowering.fresh_compiles,
        "torch_fce.integrations.transformers.apply": fce_hf.apply,
        "torch_fce.integrations.transformers.revert": fce_hf.revert,
        "torch_fce.integrations.transformers.attach": fce_hf.attach,
        "torch_fce.integrations.transformers.detach": fce_hf.detach,
        "torch_fce.integrations.trl.apply": fce_trl.apply,
        "torch_fce.integrations.trl.revert": fce_trl.revert,
        "torch_fce.integrations.trl.fused_lm_head": fce_trl.fused_lm_head,
        "torch_fce.integrations.trl.ChunkedLogProbFunction.apply":
            fce_trl.ChunkedLogProbFunction.apply,
        "torch_fce.integrations.trl.ChunkedDivergenceFunction.apply":
            fce_trl.ChunkedDivergenceFunction.apply,
        "torch_fce.integrations.trl.chunked_divergence_loss":
            fce_trl.chunked_divergence_loss,
        "torch_fce.integrations.verl.linear_cross_entropy": fce_verl.linear_cross_entropy,
        "torch_fce.integrations.verl.apply": fce_verl.apply,
        "torch_fce.integrations.verl.revert": fce_verl.revert,
        "torch_fce.distributed.vocab_parallel_linear_cross_entropy":
            vocab_parallel_linear_cross_entropy,
        "torch_fce.distributed.vocab_parallel_linear_policy_loss":
            vocab_parallel_linear_policy_loss,
        "torch_fce.distributed.vocab_parallel_linear_distillation_loss":
            vocab_parallel_linear_distillation_loss,
        "torch_fce.distributed.vocab_parallel_linear_sparse_divergence":
            vocab_parallel_linear_sparse_divergence,
        "torch_fce.distributed.vocab_parallel_linear_soft_cross_entropy":
            vocab_parallel_linear_soft_cross_entropy,
        "torch_fce.distributed.vocab_parallel_linear_topk_logprobs":
            vocab_parallel_linear_topk_logprobs,
    }.items():
        assert _sig(name, fn) in API, _sig(name, fn)

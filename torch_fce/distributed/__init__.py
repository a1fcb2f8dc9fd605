"""Vocab-parallel linear cross-entropy over torch.distributed process groups."""

from .vocab_parallel import (vocab_parallel_linear_cross_entropy,
                             vocab_parallel_linear_distillation_loss,
                             vocab_parallel_linear_logprobs, vocab_parallel_linear_policy_loss)

__all__ = ["vocab_parallel_linear_cross_entropy", "vocab_parallel_linear_logprobs",
           "vocab_parallel_linear_policy_loss", "vocab_parallel_linear_distillation_loss"]

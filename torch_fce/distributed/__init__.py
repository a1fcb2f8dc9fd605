"""The ops with the head's rows split across a torch.distributed process group
(vocab-parallel), and their DTensor entries (dtensor.py)."""

from .vocab_parallel import (vocab_parallel_linear_cross_entropy,
                             vocab_parallel_linear_distillation_loss,
                             vocab_parallel_linear_logprobs,
                             vocab_parallel_linear_policy_loss,
                             vocab_parallel_linear_soft_cross_entropy,
                             vocab_parallel_linear_sparse_divergence,
                             vocab_parallel_linear_topk_logprobs)

__all__ = ["vocab_parallel_linear_cross_entropy", "vocab_parallel_linear_logprobs",
           "vocab_parallel_linear_policy_loss", "vocab_parallel_linear_distillation_loss",
           "vocab_parallel_linear_sparse_divergence",
           "vocab_parallel_linear_soft_cross_entropy", "vocab_parallel_linear_topk_logprobs"]

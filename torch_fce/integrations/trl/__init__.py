"""TRL 1.16: GRPOTrainer's loss through torch_fce.linear_policy_loss, SFTTrainer's
through torch_fce.linear_cross_entropy, DistillationTrainer's through
torch_fce.linear_distillation_loss, the experimental Server- and
AsyncDistillationTrainer's through torch_fce.linear_sparse_divergence, torch_fce's
log-probs inside TRL's fused LM head, and drop-ins for TRL's fused kernels
(ChunkedLogProbFunction, ChunkedDivergenceFunction).

    from torch_fce.integrations import trl as fce_trl
    trainer = GRPOTrainer(model=policy, ...)   # or SFTTrainer, DistillationTrainer
    fce_trl.apply(trainer)        # the loss in three GEMMs, or a warning saying why not
    trainer.train()
    fce_trl.revert(trainer)

    with fce_trl.fused_lm_head():  # any trainer that uses add_fused_lm_head (SFT, KTO,
        trainer.train()            # RLOO, GRPO's old and reference log-probs)

apply() replaces the trainer's loss method (on the instance: GRPOTrainer's
`_compute_loss`, SFTTrainer's and ServerDistillationTrainer's `compute_loss`) by one
that runs the model's forward with
its head capturing the hidden states and forms TRL's loss, its normalisation and its
metrics from the fused op (DistillationTrainer's and AsyncDistillationTrainer's
`_compute_loss` run TRL's own, which already works from the hidden states, with its
divergence call served by torch_fce); for a configuration whose loss it cannot
reproduce exactly it warns, naming the reason, and leaves TRL's own. docs/rl.md and
docs/distillation.md list what is served.
"""

from .distill import ChunkedDivergenceFunction, chunked_divergence_loss
from .head import ChunkedLogProbFunction, fused_lm_head, per_token_logps_and_entropies
from .trainers import apply, revert

__all__ = ["apply", "revert", "fused_lm_head", "per_token_logps_and_entropies",
           "ChunkedLogProbFunction", "ChunkedDivergenceFunction", "chunked_divergence_loss"]

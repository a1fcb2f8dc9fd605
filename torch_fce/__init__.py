"""torch_fce: fused linear + cross-entropy and its family for large-vocabulary
language-model training, without the N x V logits.

Every op takes the head's input (hidden states), weight and optional bias, forms the
logits a chunk at a time in a bounded workspace, is exact by default (float32 sums),
compiles with torch.compile(fullgraph=True), never syncs with the host and never
modifies its inputs:

    linear_cross_entropy(hidden, weight, target, ...)    cross entropy (F.cross_entropy's
                                                          options, softcap, z-loss, DFT)
    linear_logprobs(hidden, weight, target, ...)         per-token log-probs, entropy
    linear_policy_loss(hidden, weight, target, adv, ...) RL policy losses (clip, CISPO,
                                                          SAPO, REINFORCE, KL, entropy)
    linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, ...)
                                                          student-teacher divergence
    linear_soft_cross_entropy(hidden, weight, idx, probs, ...)
                                                          cross entropy to sparse targets
    linear_topk_logprobs(hidden, weight, k, ...)          a teacher's top-k classes and
                                                          log-probs (no gradient)
    linear_sparse_divergence(hidden, weight, support, teacher_logprobs, ...)
                                                          a student's divergence from a
                                                          teacher's top-k
    LinearCrossEntropyLoss                                the cross entropy as a module
    workspace(bytes) / set_workspace(bytes)               the logits workspace's size

Each function's docstring gives its arguments; torch.ops.fce.* are the registered ops.
Beside them: torch_fce.lowering (torch.compile rewrites cross_entropy(linear(x, W), y)
into the op), torch_fce.integrations.transformers / .trl / .verl (one-call integrations),
torch_fce.distributed (vocab-parallel, DTensor). `python -m torch_fce` runs the main job,
`python -m torch_fce.bench --help` the benchmarks.

The documentation (docs/*.md: api.md is the contract, every option and guarantee) is in
the project's source repository and source distribution; "docs/NAME.md" in a docstring
names one of those files.
"""

from . import ops  # noqa: F401  (registers the ops)
from .distillation import (linear_distillation_loss, linear_soft_cross_entropy,
                           linear_sparse_divergence, linear_topk_logprobs)
from .functional import linear_cross_entropy, linear_logprobs, linear_policy_loss
from .modules import LinearCrossEntropyLoss
from .ops.loop.workspace import set_workspace, workspace
from .results import (DistillationStats, LogProbs, LossStats, PolicyStats,
                      SparseDivergenceStats, TopKLogprobs)

__all__ = ["linear_cross_entropy", "linear_logprobs", "linear_policy_loss",
           "linear_distillation_loss", "linear_soft_cross_entropy", "linear_sparse_divergence",
           "linear_topk_logprobs", "LogProbs", "LossStats", "PolicyStats", "DistillationStats",
           "SparseDivergenceStats", "TopKLogprobs",
           "LinearCrossEntropyLoss", "set_workspace", "workspace"]
__version__ = "0.1.0"

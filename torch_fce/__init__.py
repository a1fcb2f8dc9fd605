"""torch_fce: fused linear + cross-entropy for large-vocabulary training.

Importing the package registers torch.ops.fce.linear_ce and its kernels.
"""

from . import ops  # noqa: F401  (registers the ops)
from .functional import (linear_cross_entropy, linear_distillation_loss, linear_logprobs,
                         linear_policy_loss, linear_soft_cross_entropy)
from .modules import LinearCrossEntropyLoss
from .ops.workspace import set_workspace, workspace
from .results import DistillationStats, LogProbs, LossStats, PolicyStats

__all__ = ["linear_cross_entropy", "linear_logprobs", "linear_policy_loss",
           "linear_distillation_loss", "linear_soft_cross_entropy", "LogProbs", "LossStats", "PolicyStats",
           "DistillationStats",
           "LinearCrossEntropyLoss",
           "set_workspace", "workspace"]
__version__ = "0.1.0"

"""torch_fce: fused linear + cross-entropy for large-vocabulary training.

Importing the package registers torch.ops.fce.linear_ce and its kernels.
"""

from . import ops  # noqa: F401  (registers the ops)
from .functional import LogProbs, LossStats, linear_cross_entropy, linear_logprobs
from .modules import LinearCrossEntropyLoss
from .ops.workspace import set_workspace, workspace

__all__ = ["linear_cross_entropy", "linear_logprobs", "LogProbs", "LossStats",
           "LinearCrossEntropyLoss",
           "set_workspace", "workspace"]
__version__ = "0.1.0"

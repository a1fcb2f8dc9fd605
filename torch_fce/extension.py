"""What code built on torch_fce may use beyond the public functions: torch_fce's own
integrations and lowering pass import only the public names and these (docs/design.md).

    check_options(op, **options)           raises as the op would, naming the option
    autocast_operands(hidden, weight, bias) the operands as the ops cast them under
                                           torch.autocast (F.linear's rule, master
                                           weights and float32 biases kept)
    FLOAT_DTYPES                           the floating dtypes the ops take
    sampler_and_model_logprobs(hidden, weight, target, bias=None, *, temperature=1.0,
        **options)                         linear_logprobs' log-probs under the sampler's
                                           truncation (options' top_k, top_p, min_p) and
                                           without it, from one pass, no gradient
"""

from .ops.contract.checks import FLOAT_DTYPES
from .ops.contract.entry import autocast_operands, temperature_tensor
from .ops.linear_ce import CEOptions
from .ops.linear_distillation import DistillOptions
from .ops import linear_logprobs as _logprobs
from .ops.linear_logprobs import LogProbOptions
from .ops.linear_policy_loss import PolicyOptions
from .ops.linear_soft_ce import SoftCEOptions
from .ops.linear_sparse_divergence import SparseDivOptions
from .ops.linear_topk_logprobs import TopKOptions

__all__ = ["check_options", "autocast_operands", "FLOAT_DTYPES", "sampler_and_model_logprobs"]

_RECORDS = {"linear_cross_entropy": CEOptions, "linear_logprobs": LogProbOptions,
            "linear_policy_loss": PolicyOptions, "linear_distillation_loss": DistillOptions,
            "linear_soft_cross_entropy": SoftCEOptions, "linear_topk_logprobs": TopKOptions,
            "linear_sparse_divergence": SparseDivOptions}


def check_options(op, **options):
    """Checks keyword options of the public function `op` (e.g. "linear_logprobs") before
    any call: a ValueError or TypeError naming the option, as the call would raise."""
    if op not in _RECORDS:
        raise ValueError(f"op must be one of {sorted(_RECORDS)}, got {op!r}")
    record = _RECORDS[op]
    unknown = set(options) - set(record._fields)
    if unknown:
        raise TypeError(f"{op} has no option {sorted(unknown)[0]!r}")
    record(**options).check()


def sampler_and_model_logprobs(hidden, weight, target, bias=None, *, temperature=1.0,
                               **options):
    """(truncated, untruncated), each target's shape: the log-probs linear_logprobs gives
    with options' top_k / top_p / min_p (the sampler's distribution, -inf outside its
    kept set) and without them (the model's), from one pass of the head, without
    gradient (TRL's old-log-prob pass: its importance-sampling weight and its PPO
    ratio). options: linear_logprobs' (entropy is not computed)."""
    opts = LogProbOptions(**options).check()
    return _logprobs.sampler_and_model_logprobs(
        hidden, weight, target, bias, temperature_tensor(temperature, target), opts)

"""apply() and revert(): a TRL trainer's loss through torch_fce, reversibly, or a
warning naming why not (each trainer's refusals beside its loss)."""

import warnings

from ...extension import check_options
from .. import transformers as fce_hf
from . import distill, grpo, sft
from .common import TRL_VERSION, _base_model

# The attribute apply() leaves on a trainer: the name of the loss method it replaced.
_APPLIED = "_torch_fce_loss"


def _unsupported_trainer(trainer):
    """(the loss method apply() replaces, None) for a trainer whose loss torch_fce
    reproduces exactly, else (None, why not)."""
    import trl
    from trl import DistillationTrainer, GRPOTrainer, SFTTrainer

    if trl.__version__.rsplit(".", 1)[0] != TRL_VERSION:
        return None, (f"it reproduces TRL {TRL_VERSION}'s trainer losses, and TRL "
                      f"{trl.__version__} is installed (its loss code may differ)")
    if isinstance(trainer, GRPOTrainer):
        return "_compute_loss", grpo.unsupported(trainer)
    if isinstance(trainer, SFTTrainer):
        return "compute_loss", sft.unsupported(trainer)
    if isinstance(trainer, DistillationTrainer):
        return "_compute_loss", distill.unsupported(trainer)
    return None, (f"it serves GRPOTrainer, SFTTrainer and DistillationTrainer, got a "
                  f"{type(trainer).__name__}")


def apply(trainer, *, accumulator="fp32"):
    """Makes a TRL 1.16 GRPOTrainer, SFTTrainer or DistillationTrainer (instance,
    reversibly) compute its loss with torch_fce's fused ops; returns the trainer.

    GRPOTrainer, through linear_policy_loss: loss_type grpo, dapo, dr_grpo, bnpo, cispo
    and sapo at token-level importance sampling, any beta (the k3 KL, with or without
    the ratio's bias correction), delta, vLLM importance-sampling correction, tool
    masks, a static entropy bonus (with beta != 0 under bnpo only), MoE router losses,
    gradient accumulation, train and eval, bf16 and float32.
    SFTTrainer, through linear_cross_entropy in three GEMMs: loss_type nll and dft,
    label_smoothing_factor (without the logits), completion and assistant masks,
    padding-free batches, the MoE router aux loss, num_items_in_batch and
    average_tokens_across_devices, train and eval, and the metrics it logs (entropy,
    mean_token_accuracy, num_tokens, aux_loss) from the same pass.
    DistillationTrainer, through linear_distillation_loss in four GEMMs (TRL's kernel
    runs six, eight for the JSD): any beta and temperature, both models' logit scales,
    softcaps and head biases, completion and tool masks, num_items_in_batch, FSDP2
    (DTensor) heads gathered as TRL does, train and eval, the entropy metric, and no
    host sync (TRL's compacts the masked tokens).
    All: the same loss, gradients and logged metrics as TRL's. Anything else (GRPO's
    sequence-level importance sampling, entropy or off-policy masking, adaptive entropy,
    loss types vespo and luspo, float16; SFT's compute_loss_func, sequence, context or
    tensor parallelism; DeepSpeed ZeRO-3, a head or family torch_fce does not reproduce,
    a subclass overriding the loss, a TRL release other than 1.16; a logit scale that is
    not > 0): one warning naming the reason, and TRL's own loss. A batch apply() does not reproduce (vision inputs;
    SFT's return_outputs=True, which asks for the logits) runs TRL's loss, with a
    warning.
    """
    if hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is already applied to this trainer")
    check_options("linear_logprobs", accumulator=accumulator)
    method, why = _unsupported_trainer(trainer)
    is_distill = _is_distill(trainer)
    if why is None and not is_distill:  # the distillation reads the heads' inputs itself
        try:
            fce_hf.attach(_base_model(trainer.model))
        except ValueError as e:
            why = str(e)
    if why is not None:
        warnings.warn(f"torch_fce.integrations.trl.apply: the trainer keeps TRL's own loss: "
                      f"{why}", stacklevel=2)
        return trainer

    if is_distill:
        def loss(unwrapped_student, inputs, num_items_in_batch):
            return distill.loss(trainer, unwrapped_student, inputs, num_items_in_batch,
                                 accumulator)
    elif method == "_compute_loss":
        def loss(model, inputs):
            return grpo.loss(trainer, model, inputs, accumulator)
    else:
        def loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            return sft.loss(trainer, model, inputs, return_outputs, num_items_in_batch,
                             accumulator)

    setattr(trainer, method, loss)
    setattr(trainer, _APPLIED, method)
    return trainer


def revert(trainer):
    """Undoes apply(): TRL's own loss again."""
    if not hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is not applied to this trainer")
    delattr(trainer, vars(trainer).pop(_APPLIED))
    if not _is_distill(trainer):
        fce_hf.detach(_base_model(trainer.model))
    return trainer


def _is_distill(trainer):
    try:
        from trl import DistillationTrainer
    except ImportError:
        return False
    return isinstance(trainer, DistillationTrainer)

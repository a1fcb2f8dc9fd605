"""apply() and revert(): a TRL trainer's loss through torch_fce, reversibly, or a
warning naming why not (each trainer's refusals beside its loss)."""

import warnings
from typing import Callable, NamedTuple

from ...extension import check_options
from .. import transformers as fce_hf
from . import distill, grpo, sft, topk_distill
from .common import TRL_VERSION, _base_model

# The attribute apply() leaves on a trainer: its _Served and the names of the methods
# it set on the instance (the loss method, and match_sampler's).
_APPLIED = "_torch_fce_loss"


class _Served(NamedTuple):
    """How apply() serves a trainer: the loss method it replaces on the instance, the
    replacement's loss(trainer, *method's arguments, accumulator), whether it needs the
    model's head capturing (attach()) or reads the head's inputs itself."""
    method: str
    loss: Callable
    attaches: bool


def _served(trainer):
    """(_Served, None) for a trainer whose loss torch_fce reproduces exactly, else
    (None, why not)."""
    import trl
    from trl import DistillationTrainer, GRPOTrainer, SFTTrainer

    if trl.__version__.rsplit(".", 1)[0] != TRL_VERSION:
        return None, (f"it reproduces TRL {TRL_VERSION}'s trainer losses, and TRL "
                      f"{trl.__version__} is installed (its loss code may differ)")
    server, async_ = _experimental()
    for kind, served, why in (
            (GRPOTrainer, _Served("_compute_loss", grpo.loss, True), grpo.unsupported),
            (SFTTrainer, _Served("compute_loss", sft.loss, True), sft.unsupported),
            # before DistillationTrainer: a subclass of it
            (server, _Served("compute_loss", topk_distill.server_loss, True),
             topk_distill.unsupported_server),
            (DistillationTrainer, _Served("_compute_loss", distill.loss, False),
             distill.unsupported),
            (async_, _Served("_compute_loss", topk_distill.async_loss, False),
             topk_distill.unsupported_async)):
        if kind is not None and isinstance(trainer, kind):
            return served, why(trainer)
    return None, (f"it serves GRPOTrainer, SFTTrainer, DistillationTrainer and the "
                  f"experimental ServerDistillationTrainer and AsyncDistillationTrainer, "
                  f"got a {type(trainer).__name__}")


def _experimental():
    """TRL's experimental ServerDistillationTrainer and AsyncDistillationTrainer, None
    where their module was never imported (then the trainer is not one of them; not
    importing it spares the user TRL's experimental-API warning)."""
    import sys

    return [getattr(sys.modules.get(f"trl.experimental.{module}"), name, None)
            for module, name in (("server_distillation", "ServerDistillationTrainer"),
                                 ("async_distillation", "AsyncDistillationTrainer"))]


def apply(trainer, *, accumulator="fp32", match_sampler=False):
    """Makes a TRL 1.16 GRPOTrainer, SFTTrainer, DistillationTrainer or experimental
    Server/AsyncDistillationTrainer (instance, reversibly) compute its loss with
    torch_fce's fused ops; returns the trainer.

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
    The experimental ServerDistillationTrainer and AsyncDistillationTrainer, through
    linear_sparse_divergence in three GEMMs from the student's hidden states (the
    server trainer's TRL forms the full (B, T, V) log-softmax): beta 0 over the
    teacher's top-k, the sparse top-1 paths at beta > 0, tail on and off, the server's
    window, checks and local mean, the async trainer's support narrowing, token mask,
    normaliser, per-teacher statistics and metrics (jsd, the student's entropy,
    teacher_entropy). In float64 TRL forms the teacher's tail in float32, torch_fce in
    float64; in bf16 the server's TRL forms the student's log-softmax in bf16,
    torch_fce in float32.
    All: the same loss, gradients and logged metrics as TRL's. Anything else (GRPO's
    sequence-level importance sampling, entropy or off-policy masking, adaptive entropy,
    loss types vespo and luspo, float16; SFT's compute_loss_func, sequence, context or
    tensor parallelism; DeepSpeed ZeRO-3, a head or family torch_fce does not reproduce,
    a subclass overriding the loss, a TRL release other than 1.16; a logit scale that is
    not > 0; the server trainer's reverse_kl_top_1_mode "argmax", which needs the
    student's logits): one warning naming the reason, and TRL's own loss. A batch
    apply() does not reproduce (vision inputs; return_outputs=True, which asks for the
    logits) runs TRL's loss, with a warning.

    match_sampler=True (GRPOTrainer; it changes what TRL computes, so it is off by
    default): when its generation by vLLM truncates (top_k, top_p, min_p) and its vLLM
    importance-sampling correction is on, the correction's trainer-side log-probs are of
    the sampler's truncated distribution, as vLLM's processed log-probs are (TRL's are
    of the untruncated one, which biases the weight), while the PPO ratio keeps TRL's
    untruncated log-probs; both from one pass of the head (docs/rl.md). Where it cannot
    apply (no correction or no truncation, a repetition penalty, generation_kwargs or a
    structured-outputs regex): one warning naming the reason, and TRL's weight.
    """
    if hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is already applied to this trainer")
    check_options("linear_logprobs", accumulator=accumulator)
    served, why = _served(trainer)
    if why is None and served.attaches:  # the others read the heads' inputs themselves
        try:
            fce_hf.attach(_base_model(trainer.model))
        except ValueError as e:
            why = str(e)
    if why is not None:
        warnings.warn(f"torch_fce.integrations.trl.apply: the trainer keeps TRL's own loss: "
                      f"{why}", stacklevel=2)
        return trainer

    def loss(*args, **kwargs):
        return served.loss(trainer, *args, **kwargs, accumulator=accumulator)

    methods = {served.method: loss}
    if match_sampler:
        refusal = grpo.match_sampler_refusal(trainer) if served.loss is grpo.loss else \
            f"it serves GRPOTrainer, got a {type(trainer).__name__}"
        if refusal is None:
            methods.update(grpo.sampler_patches(trainer))
        else:
            warnings.warn(f"torch_fce.integrations.trl.apply(match_sampler=True): the "
                          f"importance-sampling weight keeps TRL's log-probs: {refusal}",
                          stacklevel=2)
    for name, method in methods.items():
        setattr(trainer, name, method)
    setattr(trainer, _APPLIED, (served, tuple(methods)))
    return trainer


def revert(trainer):
    """Undoes apply(): TRL's own loss again."""
    if not hasattr(trainer, _APPLIED):
        raise ValueError("torch_fce is not applied to this trainer")
    served, methods = vars(trainer).pop(_APPLIED)
    for name in methods:
        delattr(trainer, name)
    if served.attaches:
        fce_hf.detach(_base_model(trainer.model))
    return trainer

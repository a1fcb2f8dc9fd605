"""What the trainer integrations share: the model's head operands from one forward
(its head capturing the hidden states), the trainer checks every forward-gradient loss
makes, the batches whose forward is not reproduced."""

import warnings

import torch

from ..transformers import capture_of, head_operands, is_attached

# The TRL release whose trainer losses grpo.loss, sft.loss and distill.loss reproduce
# (and tests check).
TRL_VERSION = "1.16"


# Inputs of vision-language batches; their forward is not reproduced here.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
               "mm_token_type_ids", "image_position_ids")


def _attached(model):
    """The module attach() (or apply()) prepared, under wrappers such as
    DistributedDataParallel or a PEFT model."""
    inner = model
    while not is_attached(inner):
        if hasattr(inner, "module"):
            inner = inner.module
        elif hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        else:
            raise ValueError("this needs a model prepared by torch_fce.integrations."
                             "transformers.apply(model) (or attach(model)) first")
    return inner


def _head_inputs(model, K=None, **model_kwargs):
    """(hidden, weight, bias, softcap, outputs): the head's operands for the last K
    tokens' log-probs (position t predicts token t + 1; None: every position's hidden
    state) from one forward through `model` as given (wrappers included, so DDP's
    gradient hooks run), and the model's outputs."""
    inner = _attached(model)
    head = inner.get_output_embeddings()
    # The head, capturing, hands back its input instead of the logits.
    with capture_of(head).capturing() as capture:
        out = model(**model_kwargs)
    hidden, capture.hidden = capture.hidden, None
    hidden, bias, softcap = head_operands(inner, head,
                                          hidden if K is None else hidden[:, -K - 1:-1])
    return hidden, head.weight, bias, softcap, out


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _zero3(trainer):
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def _forward_grads_refusal(trainer, base, methods, op):
    """Why a trainer whose loss `op` serves (a loss forming its gradients in the
    forward) cannot be served, as far as every such trainer goes, or None: a subclass
    overriding one of `methods` of `base`, float16, ZeRO-3."""
    for method in methods:
        if getattr(type(trainer), method) is not getattr(base, method):
            return f"{type(trainer).__name__} overrides {method}"
    if trainer.args.fp16 or _base_model(trainer.model).dtype == torch.float16:
        return (f"float16 ({op} takes float16, but the trainer integration is checked "
                f"against TRL's losses in bf16 and float32 only: use bf16)")
    if _zero3(trainer):
        return ("DeepSpeed ZeRO-3 (the head's weight is gathered only inside its forward, "
                "and the loss reads it after)")
    return None


def _multimodal(trainer, inputs):
    """Warns and returns True for a batch with vision inputs (TRL's loss computes it)."""
    present = [k for k in _MULTIMODAL if inputs.get(k) is not None]
    if present:
        warnings.warn(f"torch_fce.integrations.trl: this batch has {present}: TRL's own "
                      "loss computes it", stacklevel=4)
    return bool(present)

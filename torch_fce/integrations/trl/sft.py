"""SFTTrainer's loss through linear_cross_entropy: what it refuses, the loss over the
labelled tokens only, and the metrics TRL logs."""

import warnings

import torch

from ...functional import linear_cross_entropy, shift_targets
from .common import _head_inputs, _multimodal, _zero3


def unsupported(trainer):
    """Why torch_fce cannot reproduce this SFTTrainer's loss exactly, or None."""
    from trl import SFTTrainer

    if type(trainer).compute_loss is not SFTTrainer.compute_loss:
        return f"{type(trainer).__name__} overrides compute_loss"
    if trainer.compute_loss_func is not None:
        return "a compute_loss_func (it is given the model's logits)"
    if trainer.args.loss_type not in ("nll", "dft"):
        return f"loss_type={trainer.args.loss_type!r} (served: nll, dft)"
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is not None and (getattr(config, "sp_enabled", False)
                               or getattr(config, "cp_enabled", False)):
        return ("sequence or context parallelism (the loss is reduced across ranks by the "
                "trainer, over pre-shifted labels)")
    if trainer.get_tp_size() > 1:
        return "tensor parallelism (the head's weight is sharded when the loss runs)"
    if _zero3(trainer):
        return ("DeepSpeed ZeRO-3 (the head's weight is gathered only inside its forward, "
                "and the loss reads it after)")
    return None


def loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None, *,
         accumulator):
    """SFTTrainer.compute_loss, for the configurations unsupported() lets through:
    one forward with the head capturing its input, then the cross entropy in three
    GEMMs, its token statistics giving TRL's metrics."""
    if return_outputs or "shift_labels" in inputs:
        why = ("return_outputs=True (the logits are asked for)" if return_outputs else
               "pre-shifted labels (shift_labels)")
        warnings.warn(f"torch_fce.integrations.trl: TRL's own loss computes this batch: "
                      f"{why}", stacklevel=3)
    if return_outputs or "shift_labels" in inputs or _multimodal(trainer, inputs):
        return type(trainer).compute_loss(trainer, model, inputs, return_outputs,
                                          num_items_in_batch)
    args = trainer.args
    mode = "train" if trainer.model.training else "eval"
    # TRL's forward arguments, without editing the caller's batch
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    kwargs["use_cache"] = False
    if trainer.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    # Only the tokens with a label reach the head (prompts and padding cost no GEMM):
    # their count is read on the host while the GPU runs the model's forward.
    target = shift_targets(inputs["labels"], -100).flatten()
    labelled = target != -100
    n, count = _count_on_host(labelled)
    hidden, weight, bias, softcap, out = _head_inputs(model, **kwargs)
    target, labelled, n = (t.to(hidden.device) for t in (target, labelled, n))
    kept = torch.argsort(labelled.to(torch.uint8), descending=True, stable=True)[:count()]
    hidden, target = hidden.flatten(0, -2).index_select(0, kept), target[kept]
    dft = args.loss_type == "dft"
    # TRL smooths the nll loss only (its dft ignores label_smoothing_factor)
    eps = args.label_smoothing_factor if trainer.label_smoother is not None and not dft \
        else 0.0
    # head_bound: the peak of the head it replaces, TRL's, at most
    loss, stats = linear_cross_entropy(
        hidden, weight, target, bias, softcap=softcap, reduction="sum", label_smoothing=eps,
        dft=dft, return_stats=True, accumulator=accumulator, head_bound=True)
    del hidden  # the op keeps no operand for its backward
    if eps > 0.0:  # transformers' LabelSmoother: its denominator is not clamped
        den = n if num_items_in_batch is None else num_items_in_batch
    else:  # TRL's: clamped, so a batch without trainable tokens gives 0
        den = torch.as_tensor(n if num_items_in_batch is None
                              else num_items_in_batch).clamp(min=1)
    loss = loss / (den.to(loss.device) if isinstance(den, torch.Tensor) else den)
    if args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled and eps == 0.0:  # TRL's smoothed loss has no aux loss
        steps = trainer.current_gradient_accumulation_steps \
            if num_items_in_batch is not None else 1
        loss = loss + trainer.router_aux_loss_coef * out.aux_loss.to(loss.device) / steps
    _log_sft_metrics(trainer, mode, inputs, n, stats, target, out)
    return loss


def _count_on_host(mask):
    """(mask.sum(), count): count() gives the sum as a host int, its copy queued now (on
    CUDA into pinned memory, so later work is queued before the host waits for it)."""
    total = mask.sum()
    if total.device.type != "cuda":
        return total, lambda: int(total)
    host = torch.empty((), dtype=total.dtype, pin_memory=True)
    host.copy_(total, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def count():
        done.synchronize()
        return int(host)
    return total, count


def _log_sft_metrics(trainer, mode, inputs, n, stats, target, out):
    """The metrics SFTTrainer.compute_loss logs, from the loss's token statistics (n
    tokens, those with a label)."""
    acc, metrics = trainer.accelerator, trainer._metrics[mode]
    num_valid = acc.gather_for_metrics(n).sum()
    entropy_sum = acc.gather_for_metrics(stats.entropy.sum()).sum()
    num_correct = acc.gather_for_metrics((stats.argmax == target).sum()).sum()
    metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(
        (num_correct / num_valid).item() if num_valid > 0 else 0.0)
    if mode == "train":  # TRL's token count: the attention mask's, or the packed row's
        if "attention_mask" in inputs:
            n = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        elif "position_ids" in inputs:
            ids = inputs["position_ids"]
            n = acc.gather_for_metrics(torch.tensor(ids.size(1), device=ids.device)).sum().item()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        trainer._total_train_tokens += n // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(acc.gather_for_metrics(out.aux_loss).mean().item())

"""HuggingFace transformers: causal LMs compute their training loss with fce::linear_ce.

    from torch_fce.integrations import transformers as fce_hf
    fce_hf.apply(model)             # options: accumulator=, z_loss=, label_smoothing=
    loss = model(input_ids, labels=labels).loss   # out.logits is None while training
    fce_hf.revert(model)

Generic over the standard CausalLM template: the model's own forward runs with its lm
head replaced, for that call only, by a capture of the head's input, so the logits are
never formed; the loss is then fce::linear_ce of those hidden states and the head's
weight (and bias), with the family's logit scaling and final softcapping. Without
labels, or in eval mode, the model runs exactly as unpatched. `apply` checks on a tiny
input that it reproduces the family's logits and refuses a family it cannot serve.
"""

import contextlib
import functools

import torch
from torch import nn

from ..functional import linear_cross_entropy

_ORIGINAL = "_torch_fce_original_forward"


def _logit_transform(config):
    """(scale, softcap) with logits = softcap(scale * (hidden @ W.T + b)) for a family."""
    scale = getattr(config, "logit_scale", None)  # cohere: logits * logit_scale
    if getattr(config, "logits_scaling", None):  # granite: logits / logits_scaling
        scale = 1.0 / config.logits_scaling
    return scale, getattr(config, "final_logit_softcapping", None)


class _Capture:
    """Installed as the head's forward: while active it returns and keeps its input (the
    hidden states) instead of computing the logits; otherwise it is the head itself.
    A flag rather than swapping forwards per call, so torch.compile can trace it."""

    def __init__(self, head):
        self.head, self.active, self.hidden = head, False, None

    def __call__(self, hidden):
        if not self.active:
            return type(self.head).forward(self.head, hidden)
        self.hidden = hidden
        return hidden

    @contextlib.contextmanager
    def capturing(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False


def _loss(model, head, hidden, labels, shift_labels, num_items_in_batch, options):
    scale, softcap = _logit_transform(model.config)
    if scale is not None:  # the bias is scaled with the product, so fold it the same way
        bias = None if head.bias is None else head.bias * scale
        hidden = hidden * scale
    else:
        bias = head.bias
    target, shift = (labels, True) if shift_labels is None else (shift_labels, False)
    loss = linear_cross_entropy(
        hidden, head.weight, target.to(hidden.device), bias, softcap=softcap, shift=shift,
        reduction="mean" if num_items_in_batch is None else "sum", **options)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


def _check_family(model, head, capture, original):
    """Raises if fce's reconstruction of the logits differs from the model's own."""
    was_training = model.training
    model.eval()
    ids = torch.arange(3, device=head.weight.device)[None] % head.weight.shape[0]
    try:
        with torch.no_grad():
            logits = original(input_ids=ids).logits
            with capture.capturing():
                original(input_ids=ids)
            hidden, capture.hidden = capture.hidden, None
            z = head(hidden).float()
    finally:
        model.train(was_training)
    scale, softcap = _logit_transform(model.config)
    if scale is not None:
        z = z * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    # Loose enough for bf16 models' own rounding, tight enough to catch any scaling.
    if z.shape != logits.shape or not torch.allclose(z, logits.float(), rtol=2e-2, atol=2e-2):
        raise ValueError(
            f"torch_fce cannot serve {type(model).__name__}: its logits are not "
            "softcap(scale * lm_head(hidden)) of a known scale/softcap")


def apply(model, *, accumulator="fp32", z_loss=0.0, label_smoothing=0.0):
    """Patches a transformers causal LM (in place, reversibly) to train without logits."""
    if hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce is already applied to this model")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model's output embeddings must be an nn.Linear, got "
                         f"{type(head).__name__}")
    original = model.forward
    capture = _Capture(head)
    head.forward = capture
    try:
        _check_family(model, head, capture, original)
    except Exception:
        del head.forward
        raise
    options = dict(accumulator=accumulator, z_loss=z_loss, label_smoothing=label_smoothing)

    @functools.wraps(original)  # keeps the signature Trainer inspects for its columns
    def forward(*args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if (labels is None and shift_labels is None) or not model.training:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(*args, labels=labels, shift_labels=shift_labels, **kwargs) \
                if shift_labels is not None else original(*args, labels=labels, **kwargs)
        return_dict = kwargs.pop("return_dict", True)
        with capture.capturing():
            out = original(*args, return_dict=True, **kwargs)
        hidden, capture.hidden = capture.hidden, None
        out.loss = _loss(model, head, hidden, labels, shift_labels, num_items_in_batch,
                         options)
        out.logits = None
        return out if return_dict else out.to_tuple()

    setattr(model, _ORIGINAL, original)
    model.forward = forward
    return model


def revert(model):
    """Undoes apply(): the model's own forward again."""
    if not hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce is not applied to this model")
    del model.forward
    del model.get_output_embeddings().forward
    delattr(model, _ORIGINAL)
    return model

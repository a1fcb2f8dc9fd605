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
Mixture-of-experts families get their router load-balancing loss added, as they add it
themselves when given labels.
"""

import contextlib
import inspect
import types

import torch
from torch import nn

from ..functional import linear_cross_entropy

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

_ORIGINAL = "_torch_fce_original_forward"
_OPTIONS = "_torch_fce_options"


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
    if isinstance(head.weight, DTensor):
        # e.g. fully_shard(lm_head) on its own: resharded as soon as the head returns,
        # and a sharded weight would route to the vocab-parallel loss, which assumes the
        # same tokens on every rank. Shard the head with the model instead.
        raise ValueError("torch_fce: the lm_head's weight is a sharded DTensor when the "
                         "loss runs; fully_shard the lm_head together with its model")
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
    setattr(model, _OPTIONS, dict(accumulator=accumulator, z_loss=z_loss,
                                  label_smoothing=label_smoothing))
    setattr(model, _ORIGINAL, original)

    # A method reading everything from `self` (no closure), so copy.deepcopy(model) gives
    # a copy that runs its own parameters; Trainer reads the original signature.
    def forward(self, *args, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        return _forward(self, args, labels, shift_labels, num_items_in_batch, kwargs)

    sig = inspect.signature(original)
    forward.__signature__ = sig.replace(parameters=[
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *sig.parameters.values()])
    forward.__doc__ = original.__doc__
    model.forward = types.MethodType(forward, model)
    return model


def _forward(model, args, labels, shift_labels, num_items_in_batch, kwargs):
    original = getattr(model, _ORIGINAL)
    if (labels is None and shift_labels is None) or not model.training:
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return original(*args, labels=labels, shift_labels=shift_labels, **kwargs) \
            if shift_labels is not None else original(*args, labels=labels, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "use_return_dict", True)
    head = model.get_output_embeddings()
    with head.forward.capturing() as capture:
        out = original(*args, return_dict=True, **kwargs)
    hidden, capture.hidden = capture.hidden, None
    loss = _loss(model, head, hidden, labels, shift_labels, num_items_in_batch,
                 getattr(model, _OPTIONS))
    aux = out.get("aux_loss")
    if aux is not None:  # MoE: loss += coef * router load-balancing loss, as with labels
        loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
    # Rebuilt without the captured hidden states in the logits slot: attribute, key and
    # tuple access all see logits as None, as after any ModelOutput(logits=None).
    out = type(out)(**{**{k: v for k, v in out.items() if k != "logits"}, "loss": loss})
    return out if return_dict else out.to_tuple()


def revert(model):
    """Undoes apply(): the model's own forward again."""
    if not hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce is not applied to this model")
    del model.forward
    del model.get_output_embeddings().forward
    delattr(model, _ORIGINAL)
    delattr(model, _OPTIONS)
    return model

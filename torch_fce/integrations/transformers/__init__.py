"""HuggingFace transformers: causal LMs compute their training loss with fce::linear_ce.

    from torch_fce.integrations import transformers as fce_hf
    fce_hf.apply(model)             # options: accumulator=, z_loss=, label_smoothing=
    loss = model(input_ids, labels=labels).loss   # out.logits is None while training
    fce_hf.revert(model)

Generic over the standard CausalLM template: the model's own forward runs with its lm
head replaced, for that call only, by a capture of the head's input, so the logits are
never formed; the loss is then fce::linear_ce of those hidden states and the head's
weight (and bias), with the family's logit scaling and final softcapping. Without
labels, or in eval mode, the model runs exactly as unpatched.

`apply` serves a plain nn.Linear head only (no forward of its own, no other parameters,
buffers, submodules or torch hooks) and refuses anything else. It checks on a tiny input,
with designed logits injected at the head, that it reproduces the family's logits, loss
and gradients, and refuses a family it cannot serve; the model is left exactly as it
was (every module's attributes, mode, submodules, parameters, buffers and hooks, the
configs and the RNG streams). Models dispatched by accelerate (device_map) keep their
hooks: the capture goes inside the head's hook; a head whose weights accelerate offloads
is refused. Mixture-of-experts families get their router load-balancing loss added, as
they add it themselves when given labels.

The package by job: capture.py (the head's input captured), family.py (the designed-
logits check of a family), snapshot.py (the model kept exactly as it was), and here the
patch: apply/revert, the users' pair, over attach/detach (the check and the capture
alone, for integrations that call the model themselves, as TRL's trainers do).
"""

import inspect
import types

import torch

from ...functional import linear_cross_entropy
from ...extension import check_options
from .capture import capture_of, check_head, install, uninstall
from .family import aux_coefficient, check_family, logit_transform
from .snapshot import model_kept

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

_ORIGINAL = "_torch_fce_original_forward"
_OPTIONS = "_torch_fce_options"


def head_operands(model, head, hidden):
    """(hidden, bias, softcap) for the head's weight, of a model apply() patched: the
    family's logit scale folded into the hidden states and the bias (the bias is scaled
    with the product), the hidden states on the head's device (as the head would need)."""
    if isinstance(head.weight, DTensor):
        # e.g. fully_shard(lm_head) on its own: resharded as soon as the head returns,
        # and a sharded weight would route to the vocab-parallel op, which assumes the
        # same tokens on every rank. Shard the head with the model instead.
        raise ValueError("torch_fce: the lm_head's weight is a sharded DTensor when the "
                         "loss runs; fully_shard the lm_head together with its model")
    scale, softcap = logit_transform(model.config, getattr(model, _OPTIONS)["scale_rule"])
    hidden, bias = hidden.to(head.weight.device), head.bias
    if scale is not None:
        bias = None if bias is None else bias * scale
        hidden = hidden * scale
    return hidden, bias, softcap


def _loss(model, head, hidden, labels, shift_labels, num_items_in_batch, options):
    hidden, bias, softcap = head_operands(model, head, hidden)
    target, shift = (labels, True) if shift_labels is None else (shift_labels, False)
    loss = linear_cross_entropy(
        hidden, head.weight, target.to(hidden.device), bias, softcap=softcap, shift=shift,
        reduction="mean" if num_items_in_batch is None else "sum",
        **{k: v for k, v in options.items() if k != "scale_rule"})
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch.to(loss.device) \
            if isinstance(num_items_in_batch, torch.Tensor) else loss / num_items_in_batch
    return loss


def attach(model):
    """Checks that torch_fce reproduces the model's logits and installs the capture of
    its head's input, leaving the model's forward as it is (in place, reversibly, by
    detach()): what apply() builds on, and what integrations that call the model
    themselves (TRL's trainers) need. Raises ValueError naming what it cannot serve."""
    if hasattr(model, _OPTIONS):
        raise ValueError("torch_fce is already applied to this model")
    head = model.get_output_embeddings()
    check_head(head, type(model).__name__)
    capture = install(head)
    try:
        with model_kept(model):
            model.eval()  # no dropout in the check
            rule = check_family(model, head, capture, model.forward)
    except Exception:
        uninstall(head)
        raise
    setattr(model, _OPTIONS, dict(scale_rule=rule))
    return model


def is_attached(model):
    """Whether attach() (or apply()) prepared this very module."""
    return hasattr(model, _OPTIONS)


def detach(model):
    """Undoes attach()."""
    if hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce's forward is applied to this model: call revert()")
    if not hasattr(model, _OPTIONS):
        raise ValueError("torch_fce is not applied to this model")
    uninstall(model.get_output_embeddings())
    delattr(model, _OPTIONS)
    return model


def apply(model, *, accumulator="fp32", z_loss=0.0, label_smoothing=0.0):
    """Patches a transformers causal LM (in place, reversibly) to train without logits."""
    check_options("linear_cross_entropy", label_smoothing=label_smoothing, z_loss=z_loss,
                  accumulator=accumulator)
    original = model.forward  # accelerate's hook wrapper, if dispatched: kept inside
    attach(model)
    getattr(model, _OPTIONS).update(accumulator=accumulator, z_loss=z_loss,
                                    label_smoothing=label_smoothing)
    # The model's instance forward (an accelerate hook's), restored by revert().
    setattr(model, _ORIGINAL, (original, vars(model).get("forward")))

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
    original = getattr(model, _ORIGINAL)[0]
    if args:  # positional arguments (labels among them, maybe) by their names
        bound = inspect.signature(original).bind_partial(*args)
        twice = set(bound.arguments) & (set(kwargs) | ({"labels"} if labels is not None
                                                       else set()))
        if twice:  # as the unpatched forward
            raise TypeError(f"forward() got multiple values for {sorted(twice)}")
        kwargs = {**bound.arguments, **kwargs}
        labels = kwargs.pop("labels", labels)
        args = ()
    if (labels is None and shift_labels is None) or not model.training:
        if num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        return original(*args, labels=labels, shift_labels=shift_labels, **kwargs) \
            if shift_labels is not None else original(*args, labels=labels, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    head = model.get_output_embeddings()
    with capture_of(head).capturing() as capture:
        out = original(*args, return_dict=True, **kwargs)
    hidden, capture.hidden = capture.hidden, None
    loss = _loss(model, head, hidden, labels, shift_labels, num_items_in_batch,
                 getattr(model, _OPTIONS))
    aux = out.get("aux_loss")
    if aux is not None:  # MoE: loss += coef * router load-balancing loss, as with labels
        loss = loss + aux_coefficient(model) * aux.to(loss.device)
    # Rebuilt without the captured hidden states in the logits slot: attribute, key and
    # tuple access all see logits as None, as after any ModelOutput(logits=None).
    out = type(out)(**{**{k: v for k, v in out.items() if k != "logits"}, "loss": loss})
    return out if return_dict else out.to_tuple()


def revert(model):
    """Undoes apply(): the model's own forward again (and its accelerate hooks)."""
    if not hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce is not applied to this model")
    instance_forward = getattr(model, _ORIGINAL)[1]
    if instance_forward is None:
        del model.forward
    else:
        model.forward = instance_forward
    delattr(model, _ORIGINAL)
    return detach(model)

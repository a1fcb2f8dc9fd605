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
"""

import contextlib
import copy
import inspect
import types

import torch
from torch import nn

from ..functional import linear_cross_entropy
from ..ops.linear_ce import CEOptions

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

_ORIGINAL = "_torch_fce_original_forward"
_OPTIONS = "_torch_fce_options"


# How a family scales its logits after the head: logits = scale * lm_head(hidden), with
# scale read from the config at every call. apply() picks the rule that reproduces the
# family's logits (MiniCPM3's logits_scaling divides the hidden states before the head,
# Granite's the logits after it: the name alone does not tell).
_SCALES = {
    "none": lambda config: None,
    "logit_scale": lambda config: getattr(config, "logit_scale", None),  # cohere: *
    "logits_scaling": lambda config: 1.0 / config.logits_scaling,  # granite: /
}


def _scale_rules(config):
    """The rules that could apply to this config, the name-based guess first."""
    rules = [r for r in ("logit_scale", "logits_scaling") if getattr(config, r, None)]
    return rules + ["none"]


def _logit_transform(config, rule):
    """(scale, softcap) with logits = softcap(scale * (hidden @ W.T + b))."""
    return _SCALES[rule](config), getattr(config, "final_logit_softcapping", None)


class _Capture:
    """Installed as the head's forward (inside an accelerate hook, if the head has
    one): while active it keeps its input (the hidden states) and returns
    `replace(hidden)` (default: the hidden states themselves) instead of computing the
    logits; otherwise it is the head's own forward. A flag rather than swapping
    forwards per call, so torch.compile can trace it."""

    def __init__(self, head, inner):
        self.head, self.inner = head, inner
        self.active, self.hidden, self.replace = False, None, None

    def __call__(self, hidden):
        if not self.active:
            return self.inner(hidden)
        self.hidden = hidden
        return hidden if self.replace is None else self.replace(hidden)

    @contextlib.contextmanager
    def capturing(self, replace=None):
        self.active, self.replace = True, replace
        try:
            yield self
        finally:
            self.active, self.replace = False, None


def _check_head(head, name):
    """Raises unless the head is a plain nn.Linear that apply() reproduces exactly."""
    why = None
    extra = [n for n, _ in head.named_parameters() if n not in ("weight", "bias")] \
        if isinstance(head, nn.Module) else []
    if not isinstance(head, nn.Linear):
        why = f"its output embeddings are a {type(head).__name__}, not an nn.Linear"
    elif type(head).forward is not nn.Linear.forward:
        why = f"its lm_head ({type(head).__name__}) has a forward of its own"
    elif extra:
        why = f"its lm_head holds other parameters ({', '.join(extra)})"
    elif list(head.buffers()) or list(head.children()):
        why = "its lm_head holds buffers or submodules"
    elif any(getattr(head, a) for a in ("_forward_hooks", "_forward_pre_hooks",
                                        "_backward_hooks", "_backward_pre_hooks")):
        why = "its lm_head has torch hooks, which would see hidden states, not logits"
    elif "forward" in vars(head) and not _accelerate_hooked(head):
        why = "its lm_head's forward was replaced on the instance (not by an accelerate hook)"
    elif head.weight.is_meta or (head.bias is not None and head.bias.is_meta):
        why = ("its lm_head's weights are offloaded (on the meta device outside its "
               "forward, as accelerate's offloading leaves them): dispatch the lm_head to "
               "a device without offloading")
    if why:
        raise ValueError(f"torch_fce cannot serve {name}: {why}; apply() serves a plain "
                         "nn.Linear head (weight, bias) only")


def _accelerate_hooked(module):
    """An accelerate hook: its forward wrapper calls module._old_forward."""
    return hasattr(module, "_hf_hook") and "_old_forward" in vars(module)


def _install(head):
    """The capture, as the head's forward or, under an accelerate hook, as the forward
    the hook calls (so the hook still moves the hidden states to the head's device)."""
    if _accelerate_hooked(head):
        capture = _Capture(head, head._old_forward)
        head._old_forward = capture
    else:
        capture = _Capture(head, types.MethodType(type(head).forward, head))
        head.forward = capture
    return capture


def _uninstall(head):
    if _accelerate_hooked(head) and isinstance(head._old_forward, _Capture):
        head._old_forward = head._old_forward.inner
    else:
        del head.forward


def capture_of(head):
    return head._old_forward if _accelerate_hooked(head) else head.forward


# Attribute names families give the router load-balancing loss's coefficient.
_AUX_COEF_NAMES = ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha",
                   "moe_aux_loss_coeff", "router_aux_loss_coeff")


def _aux_coefficient(model):
    for owner in (model, model.config):
        for name in _AUX_COEF_NAMES:
            if getattr(owner, name, None) is not None:
                return getattr(owner, name)
    raise ValueError(f"torch_fce cannot serve {type(model).__name__}: it returns a router "
                     f"auxiliary loss, but none of {_AUX_COEF_NAMES} names its coefficient")

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
    scale, softcap = _logit_transform(model.config, getattr(model, _OPTIONS)["scale_rule"])
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


def _designed_logits(hidden, labels, V):
    """float64 logits whose loss tells every definition apart: each position's logits
    peak by 8 at the next position's label (a shifted loss is small, an unshifted one
    large), with magnitudes up to 40 (a softcap or a scale shows) and noise. Made on
    the CPU (whatever the default device), then moved to the hidden states' device."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T = hidden.shape[:2]
    cpu = dict(dtype=torch.float64, device="cpu")
    z = torch.randn(B, T, V, generator=g, **cpu) * 4.0 \
        + torch.linspace(-40.0, 40.0, V, **cpu)
    nxt = labels[:, 1:].clamp_min(0).cpu()
    z[:, :-1].scatter_add_(-1, nxt[..., None], torch.full((B, T - 1, 1), 8.0, **cpu))
    return z.to(hidden.device)


def _transformed(model, z, rule):
    """softcap(scale * z): the family's logits as apply() reconstructs them."""
    scale, softcap = _logit_transform(model.config, rule)
    z = z if scale is None else z * scale
    return z if not softcap else softcap * torch.tanh(z / softcap)


def _check_family(model, head, capture, original):
    """Returns the scale rule with which apply() reproduces the family's logits, loss
    and gradients; raises if there is none.

    The head is made to return designed float64 logits, so whatever the family does
    after it (scaling, softcapping, shifting, extra loss terms, learnable parameters)
    acts on known values at float64/float32 precision rather than on a tiny model's
    near-uniform logits. Compared on the CPU: a dispatched model's outputs may be
    anywhere."""
    V = head.weight.shape[0]
    ids = torch.arange(8, device=head.weight.device)[None] % V
    labels = ids.roll(-3, 1)
    labels[0, 2] = -100
    made, name = {}, type(model).__name__

    def design(hidden):
        made["z"] = _designed_logits(hidden, labels, V)
        return made["z"]

    with torch.enable_grad():
        with capture.capturing(design):
            out = original(input_ids=ids, labels=labels)
        capture.hidden = None
        if "z" not in made:
            raise ValueError(f"torch_fce cannot serve {name}: its forward does not call its "
                             "output embeddings module (get_output_embeddings())")
        z = made["z"].detach().cpu()
        got = None if out.logits is None else out.logits.detach().double().cpu()
        rule = next((r for r in _scale_rules(model.config)
                     if got is not None and got.shape == z.shape and torch.allclose(
                         got, _transformed(model, z, r), rtol=1e-5, atol=1e-5)), None)
        if rule is None:
            raise ValueError(f"torch_fce cannot serve {name}: its logits are not "
                             "softcap(scale * lm_head(hidden)) of a known scale/softcap")
        logits = _transformed(model, z, rule)
        aux = out.get("aux_loss")
        want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten().cpu())
        if aux is not None:
            want = want + _aux_coefficient(model) * aux.detach().double().cpu()
        if out.loss is None or not torch.allclose(out.loss.detach().double().cpu(), want,
                                                  rtol=1e-5):
            raise ValueError(
                f"torch_fce cannot serve {name}: its loss is not the shifted cross entropy "
                "of its logits (+ its router loss): it gives "
                f"{None if out.loss is None else out.loss.item()}, apply() {want.item()}")
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params or not out.logits.requires_grad:
            return rule
        grads = torch.autograd.grad(out.logits.double().sum(), [p for _, p in params],
                                    allow_unused=True)
    after = [n for (n, _), g in zip(params, grads) if g is not None]
    if after:
        raise ValueError(f"torch_fce cannot serve {name}: parameters act on the logits "
                         f"after the lm_head ({', '.join(after[:4])}), which apply() would "
                         "leave without a gradient")
    return rule


_CONTAINERS = (dict, list, set)


def _contents(value):
    return copy.copy(value) if isinstance(value, _CONTAINERS) else None


def _put_back(value, contents):
    """value, its contents (if a container, mutated in place) as when saved."""
    if contents is not None:
        value.clear()
        (value.extend if isinstance(value, list) else value.update)(contents)
    return value


@contextlib.contextmanager
def _model_kept(model):
    """The model exactly as it was, whatever the check's forward does to it: every
    module's attributes (its mode, submodules, parameters, buffers and hooks, with the
    dicts and lists holding them put back in place), buffer values, every config, and
    the RNG streams. A parameter modified in place cannot be undone: that refuses."""
    from transformers.configuration_utils import PretrainedConfig

    # Modules and configs alike keep their own objects, put back in place: submodules
    # hold these very config objects.
    configs = [model.config] + [v for v in vars(model.config).values()
                                if isinstance(v, PretrainedConfig)]
    attrs = [(o, {k: (v, _contents(v)) for k, v in vars(o).items()})
             for o in [*model.modules(), *configs]]
    buffers = {id(b): (b, b._version, b.detach().clone()) for b in model.buffers()}
    versions = [(n, p, p._version) for n, p in model.named_parameters()]
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for o, kept in attrs:
            vars(o).clear()
            vars(o).update({k: _put_back(v, c) for k, (v, c) in kept.items()})
        for b, version, value in buffers.values():
            if b._version != version:
                with torch.no_grad():
                    b.copy_(value)
    changed = [n for n, p, v in versions if p._version != v]
    if changed:
        raise ValueError(f"torch_fce cannot serve {type(model).__name__}: its forward "
                         f"modified parameters in place ({', '.join(changed[:4])})")


def attach(model):
    """Checks that torch_fce reproduces the model's logits and installs the capture of
    its head's input, leaving the model's forward as it is (in place, reversibly, by
    detach()): what apply() builds on, and what integrations that call the model
    themselves (TRL's trainers) need. Raises ValueError naming what it cannot serve."""
    if hasattr(model, _OPTIONS):
        raise ValueError("torch_fce is already applied to this model")
    head = model.get_output_embeddings()
    _check_head(head, type(model).__name__)
    capture = _install(head)
    try:
        with _model_kept(model):
            model.eval()  # no dropout in the check
            rule = _check_family(model, head, capture, model.forward)
    except Exception:
        _uninstall(head)
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
    _uninstall(model.get_output_embeddings())
    delattr(model, _OPTIONS)
    return model


def apply(model, *, accumulator="fp32", z_loss=0.0, label_smoothing=0.0):
    """Patches a transformers causal LM (in place, reversibly) to train without logits."""
    CEOptions(label_smoothing=label_smoothing, z_loss=z_loss, accumulator=accumulator).check()
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
        loss = loss + _aux_coefficient(model) * aux.to(loss.device)
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

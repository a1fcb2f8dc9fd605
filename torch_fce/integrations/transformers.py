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
input, with designed logits injected at the head, that it reproduces the family's loss
and that no parameter acts after the head, and refuses a family it cannot serve; the
check leaves the model's modes and config as they were.
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
    """Installed as the head's forward: while active it keeps its input (the hidden
    states) and returns `replace(hidden)` (default: the hidden states themselves)
    instead of computing the logits; otherwise it is the head itself. A flag rather
    than swapping forwards per call, so torch.compile can trace it."""

    def __init__(self, head):
        self.head, self.active, self.hidden, self.replace = head, False, None, None

    def __call__(self, hidden):
        if not self.active:
            return type(self.head).forward(self.head, hidden)
        self.hidden = hidden
        return hidden if self.replace is None else self.replace(hidden)

    @contextlib.contextmanager
    def capturing(self, replace=None):
        self.active, self.replace = True, replace
        try:
            yield self
        finally:
            self.active, self.replace = False, None


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


def _designed_logits(hidden, labels, V):
    """float64 logits whose loss tells every definition apart: each position's logits
    peak by 8 at the next position's label (a shifted loss is small, an unshifted one
    large), with magnitudes up to 40 (a softcap or a scale shows) and noise."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, T = hidden.shape[:2]
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 4.0 \
        + torch.linspace(-40.0, 40.0, V, dtype=torch.float64)
    nxt = labels[:, 1:].clamp_min(0)
    z[:, :-1].scatter_add_(-1, nxt[..., None], torch.full((B, T - 1, 1), 8.0,
                                                         dtype=torch.float64))
    return z.to(hidden.device)


def _transformed(model, z):
    """softcap(scale * z): the family's logits as apply() reconstructs them."""
    scale, softcap = _logit_transform(model.config)
    z = z if scale is None else z * scale
    return z if not softcap else softcap * torch.tanh(z / softcap)


def _check_family(model, head, capture, original):
    """Raises unless apply() reproduces the family's logits, loss and gradients.

    The head is made to return designed float64 logits, so whatever the family does
    after it (scaling, softcapping, shifting, extra loss terms, learnable parameters)
    acts on known values at float64/float32 precision rather than on a tiny model's
    near-uniform logits."""
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
        z = made["z"].detach()
        logits = _transformed(model, z)
        if out.logits is None or out.logits.shape != z.shape or not torch.allclose(
                out.logits.double(), logits, rtol=1e-5, atol=1e-5):
            raise ValueError(f"torch_fce cannot serve {name}: its logits are not "
                             "softcap(scale * lm_head(hidden)) of a known scale/softcap")
        aux = out.get("aux_loss")
        want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten())
        if aux is not None:
            want = want + _aux_coefficient(model) * aux.detach().double()
        if out.loss is None or not torch.allclose(out.loss.double(), want, rtol=1e-5):
            raise ValueError(
                f"torch_fce cannot serve {name}: its loss is not the shifted cross entropy "
                "of its logits (+ its router loss): it gives "
                f"{None if out.loss is None else out.loss.item()}, apply() {want.item()}")
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params or not out.logits.requires_grad:
            return
        grads = torch.autograd.grad(out.logits.double().sum(), [p for _, p in params],
                                    allow_unused=True)
    after = [n for (n, _), g in zip(params, grads) if g is not None]
    if after:
        raise ValueError(f"torch_fce cannot serve {name}: parameters act on the logits "
                         f"after the lm_head ({', '.join(after[:4])}), which apply() would "
                         "leave without a gradient")


@contextlib.contextmanager
def _state_kept(model):
    """Every module's train/eval flag and every config attribute (the attention
    implementation, say) as they were, whatever the check's forward changes."""
    from transformers.configuration_utils import PretrainedConfig

    flags = [(m, m.training) for m in model.modules()]
    configs = [model.config] + [v for v in vars(model.config).values()
                                if isinstance(v, PretrainedConfig)]
    saved = [(c, dict(vars(c))) for c in configs]
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        for c, attrs in saved:
            vars(c).clear()
            vars(c).update(attrs)


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
        with _state_kept(model):
            model.eval()  # no dropout in the check
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
    with head.forward.capturing() as capture:
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
    """Undoes apply(): the model's own forward again."""
    if not hasattr(model, _ORIGINAL):
        raise ValueError("torch_fce is not applied to this model")
    del model.forward
    del model.get_output_embeddings().forward
    delattr(model, _ORIGINAL)
    delattr(model, _OPTIONS)
    return model

"""The family check: with designed float64 logits injected at the head, which logit
scale and softcap reproduce the family's logits, loss (and router loss) and gradients,
or why none does."""

import torch

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


def logit_transform(config, rule):
    """(scale, softcap) with logits = softcap(scale * (hidden @ W.T + b))."""
    return _SCALES[rule](config), getattr(config, "final_logit_softcapping", None)


# Attribute names families give the router load-balancing loss's coefficient.
_AUX_COEF_NAMES = ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha",
                   "moe_aux_loss_coeff", "router_aux_loss_coeff")


def aux_coefficient(model):
    for owner in (model, model.config):
        for name in _AUX_COEF_NAMES:
            if getattr(owner, name, None) is not None:
                return getattr(owner, name)
    raise ValueError(f"torch_fce cannot serve {type(model).__name__}: it returns a router "
                     f"auxiliary loss, but none of {_AUX_COEF_NAMES} names its coefficient")


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
    scale, softcap = logit_transform(model.config, rule)
    z = z if scale is None else z * scale
    return z if not softcap else softcap * torch.tanh(z / softcap)


def check_family(model, head, capture, original):
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
            want = want + aux_coefficient(model) * aux.detach().double().cpu()
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

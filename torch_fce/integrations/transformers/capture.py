"""Capturing the lm head's input: the head's forward replaced (inside an accelerate hook,
if it has one) by a capture that keeps the hidden states and returns them, or designed
logits, instead of computing the logits; and the refusal of heads it cannot stand in
for."""

import contextlib
import types

from torch import nn


class Capture:
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


def check_head(head, name):
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
    elif "forward" in vars(head) and not accelerate_hooked(head):
        why = "its lm_head's forward was replaced on the instance (not by an accelerate hook)"
    elif head.weight.is_meta or (head.bias is not None and head.bias.is_meta):
        why = ("its lm_head's weights are offloaded (on the meta device outside its "
               "forward, as accelerate's offloading leaves them): dispatch the lm_head to "
               "a device without offloading")
    if why:
        raise ValueError(f"torch_fce cannot serve {name}: {why}; apply() serves a plain "
                         "nn.Linear head (weight, bias) only")


def accelerate_hooked(module):
    """An accelerate hook: its forward wrapper calls module._old_forward."""
    return hasattr(module, "_hf_hook") and "_old_forward" in vars(module)


def install(head):
    """The capture, as the head's forward or, under an accelerate hook, as the forward
    the hook calls (so the hook still moves the hidden states to the head's device)."""
    if accelerate_hooked(head):
        capture = Capture(head, head._old_forward)
        head._old_forward = capture
    else:
        capture = Capture(head, types.MethodType(type(head).forward, head))
        head.forward = capture
    return capture


def uninstall(head):
    if accelerate_hooked(head) and isinstance(head._old_forward, Capture):
        head._old_forward = head._old_forward.inner
    else:
        del head.forward


def capture_of(head):
    return head._old_forward if accelerate_hooked(head) else head.forward

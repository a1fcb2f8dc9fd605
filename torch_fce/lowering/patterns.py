"""Recognising cross_entropy(linear(x, W)) in Dynamo's pre-grad FX graphs.

A match walks back from an F.cross_entropy node through the logits' producers, each of
which must have no other user: views that keep the vocabulary dimension last, slices of
leading dimensions (the causal-LM shift) taken before any such view, one cut of a padded
vocabulary (`logits[..., :V]`: the head's first V rows), an upcast, the Gemma softcap
`tanh(z / c) * c`, down to F.linear / nn.Linear / `x @ W.T`, whose weight and bias may be
cast from float32 to the activations' dtype (`w.to(x.dtype)`, `w.type_as(x)`: the op's
master-weight path).
Anything else ends the walk with a reason, and the graph is left as it was; so do
inputs the op would reject, and a grad-mode or autocast switch between the linear and
the cross entropy (the fused op runs where the cross entropy ran).
"""

import dataclasses
import inspect
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..extension import FLOAT_DTYPES

# F.cross_entropy as Dynamo records it, and the ATen-level call some torch versions
# record instead (its reduction is an enum).
CROSS_ENTROPY = (F.cross_entropy, torch._C._nn.cross_entropy_loss)
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
LINEAR = (torch._C._nn.linear,)
MATMUL = (operator.matmul, torch.matmul)
TANH = (torch.tanh,)
# Dynamo records `with torch.no_grad()` / `torch.autocast` blocks as these calls.
_GLOBAL_STATE = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast",
                 "_enter_inference_mode", "_exit_inference_mode")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
OTHER_USE = "the logits have another use"  # a reason of its own: the pass warns on it


@dataclasses.dataclass
class Match:
    cross_entropy: Node
    loss_dtype: torch.dtype  # cross_entropy's output dtype, kept by the rewrite
    hidden: Node
    weight: Node
    bias: Optional[Node]
    target: Node
    class_weight: Optional[Node]
    options: dict
    leading_slices: list  # getitem indices to apply to hidden, in order
    chain: list  # logits producers to erase, consumer first
    vocab_rows: Optional[int] = None  # logits[..., :V] of a padded head: its first V rows


class NoMatch(Exception):
    """Why a cross_entropy node was left unfused (the message is the reason)."""


def _meta(node):
    # Dynamo records "example_value"; graphs that went through fake propagation, "val".
    val = (node.meta.get("example_value", node.meta.get("val"))
           if isinstance(node, Node) else None)
    if not isinstance(val, torch.Tensor):
        raise NoMatch("no tensor metadata")
    return val


def _is_method(node, *names):
    return node.op == "call_method" and node.target in names


def _arg(node, i, name):
    """The i-th positional argument of a call, or its keyword `name` (None if absent)."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _only_user(node, user):
    if len(node.users) != 1:
        raise NoMatch(OTHER_USE)
    assert user in node.users


def _ce_options(node):
    if node.target is torch._C._nn.cross_entropy_loss:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        a = dict(zip(names, (None, None, None, 1, -100, 0.0)))
        a.update(zip(names, node.args), **node.kwargs, size_average=None, reduce=None)
        a["reduction"] = _REDUCTIONS.get(a["reduction"], a["reduction"])
    else:
        bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        a = bound.arguments
    if a["size_average"] is not None or a["reduce"] is not None:
        raise NoMatch("legacy size_average/reduce arguments")
    for name in ("ignore_index", "reduction", "label_smoothing"):
        if isinstance(a[name], Node):
            raise NoMatch(f"{name} is a tensor")
    return a


def _softcap(mul_node):
    """c if mul_node is tanh(z / c) * c (either operand order), else None."""
    if mul_node.op != "call_function" or mul_node.target not in (operator.mul, torch.mul):
        return None
    if len(mul_node.args) != 2 or mul_node.kwargs:
        return None
    a, b = mul_node.args
    tanh, c = (a, b) if isinstance(a, Node) else (b, a)
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not isinstance(tanh, Node):
        return None
    if not (tanh.op == "call_function" and tanh.target in TANH or _is_method(tanh, "tanh")):
        return None
    div = tanh.args[0] if tanh.args else None
    if not (isinstance(div, Node) and div.op == "call_function" and not div.kwargs
            and div.target in (operator.truediv, torch.div) and len(div.args) == 2
            and div.args[1] == c
            and len(tanh.users) == 1 and len(div.users) == 1):
        return None
    if c == 0:
        raise NoMatch("softcap constant is 0")
    return abs(float(c)), div  # tanh(z / c) * c is even in c; the op takes c > 0


def _vocab_slice(index, ndim, V):
    """(leading index or None, True) if index is `[..., :V]` (possibly with leading
    slices) on an ndim-dim tensor, cutting the vocabulary to its first V entries."""
    items = index if isinstance(index, tuple) else (index,)
    last = items[-1] if items else None
    if not (isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1)
            and last.stop == V and (Ellipsis in items or len(items) == ndim)):
        return None
    lead = items[:-1] + (slice(None, None, None),)
    if not _keeps_last_dim(lead, ndim):
        return None
    trivial = all(i == slice(None, None, None) or i is Ellipsis for i in lead)
    return None if trivial else lead, True


def _uncast(node, dtype):
    """x if node is x.to(dtype) / x.type_as(y) / x.bfloat16() / x.half() of a float32 x
    with node as its only use, giving dtype (the op's master-weight path), else node."""
    if not isinstance(node, Node) or node.op != "call_method" or len(node.users) != 1:
        return node
    src = node.args[0]
    if not isinstance(src, Node) or node.target not in ("to", "type_as", "bfloat16", "half"):
        return node
    if node.target == "to" and node.kwargs.keys() - {"dtype"}:
        return node
    try:
        ok = _meta(src).dtype == torch.float32 and _meta(node).dtype == dtype != src
    except NoMatch:
        return node
    return src if ok and _meta(src).shape == _meta(node).shape else node


def _keeps_last_dim(index, ndim):
    """A getitem index that slices only leading dimensions."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return False
    if Ellipsis not in items and len(items) < ndim:
        return True
    return items[-1] == slice(None, None, None)


def _transposed_weight(node):
    """W if node is W.T / W.t() / W.transpose(0, 1) of a 2-D W, else None."""
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        w = node.args[0]
    elif _is_method(node, "t") or node.op == "call_function" and node.target is torch.t:
        w = node.args[0]
    elif _is_method(node, "transpose") and sorted(node.args[1:3]) in ([0, 1], [-2, -1]):
        w = node.args[0]
    else:
        return None
    return w if isinstance(w, Node) and _meta(w).dim() == 2 and len(node.users) == 1 else None


def match(ce):
    """Returns a Match for an F.cross_entropy node, or raises NoMatch with the reason."""
    a = _ce_options(ce)
    logits, V = a["input"], None
    if not isinstance(logits, Node) or _meta(logits).dim() != 2:
        raise NoMatch("cross_entropy input is not (N, V) logits")
    V = _meta(logits).shape[-1]
    softcap, slices, chain, node, user = None, [], [], logits, ce
    V_out, vocab_rows = V, None
    while True:
        _only_user(node, user)
        chain.append(node)
        if node.op == "call_function" and node.target in LINEAR:
            hidden, weight = _arg(node, 0, "input"), _arg(node, 1, "weight")
            bias = _arg(node, 2, "bias")
            dtype = _meta(hidden).dtype if isinstance(hidden, Node) else None
            for cast in (weight, bias):  # F.linear(x, w.to(x.dtype)): a master weight
                if _uncast(cast, dtype) is not cast:
                    chain.append(cast)
            weight, bias = _uncast(weight, dtype), _uncast(bias, dtype)
            break
        if node.op == "call_function" and node.target in MATMUL:
            hidden, wt = _arg(node, 0, "input"), _arg(node, 1, "other")
            weight = _transposed_weight(wt) if isinstance(wt, Node) else None
            if weight is None:
                raise NoMatch("matmul with something other than a transposed 2-D weight")
            chain.append(wt)
            bias = None
            break
        capped = _softcap(node)
        if capped is not None and softcap is None:
            softcap, div = capped
            chain += [node.args[0] if isinstance(node.args[0], Node) else node.args[1]]
            user, node = div, div.args[0]
            chain.append(div)
            continue
        if _is_method(node, "float") or _is_method(node, "to") and (
                torch.float32 in node.args[1:] or node.kwargs.get("dtype") == torch.float32):
            pass
        elif _is_method(node, "contiguous"):
            pass
        elif _is_method(node, "view", "reshape", "flatten"):
            if _meta(node).shape[-1] != V or _meta(node.args[0]).shape[-1] != V:
                raise NoMatch("a reshape changes the vocabulary dimension")
            if slices:  # the slice indexes the reshaped dims, not hidden's
                raise NoMatch("a slice of reshaped logits")
        elif node.op == "call_function" and node.target is operator.getitem:
            try:
                src = _meta(node.args[0])
            except NoMatch:  # an item of a tuple: split / chunk / unbind of the logits
                raise NoMatch("logits are one piece of a split (a hand-chunked loss)") \
                    from None
            cut = _vocab_slice(node.args[1], src.dim(), V) \
                if vocab_rows is None and src.shape[-1] > V else None
            if cut is not None:  # a padded head: logits[..., :V] is the first V rows
                vocab_rows, V = V, src.shape[-1]
                if cut[0] is not None:
                    slices.insert(0, cut[0])
            elif not _keeps_last_dim(node.args[1], src.dim()):
                raise NoMatch("an index touches the vocabulary dimension")
            else:
                slices.insert(0, node.args[1])
        else:
            name = getattr(node.target, "__name__", node.target)
            raise NoMatch(f"logits come from {node.op} {name}")
        user, node = node, node.args[0]
        if not isinstance(node, Node):
            raise NoMatch("logits do not come from a tensor")
    _check_match(hidden, weight, bias, a["target"], a["weight"], V, V_out)
    _check_same_state(node, ce)
    options = dict(ignore_index=a["ignore_index"], reduction=a["reduction"],
                   label_smoothing=float(a["label_smoothing"]), softcap=softcap)
    return Match(ce, _meta(ce).dtype, hidden, weight, bias, a["target"], a["weight"],
                 options, slices, chain, vocab_rows)


def _check_same_state(linear, ce):
    """The fused op replaces the cross entropy: refuse if grad mode or autocast changes
    between the two (e.g. the linear under autocast, the loss after it)."""
    node = linear.next
    while node is not ce:
        if node.op == "call_function" and getattr(node.target, "__name__", "") \
                in _GLOBAL_STATE:
            raise NoMatch("grad mode or autocast changes between linear and cross_entropy")
        node = node.next


def _check_match(hidden, weight, bias, target, class_weight, V, V_out):
    """What the op would reject (it would fail the compile), as NoMatch instead. V is the
    head's rows, V_out the classes the loss sees (fewer for a padded head)."""
    h, w, t = _meta(hidden), _meta(weight), _meta(target)
    if h.dtype not in FLOAT_DTYPES or w.dtype not in (h.dtype, torch.float32):
        raise NoMatch(f"unsupported dtypes hidden={h.dtype} weight={w.dtype}")
    if h.dim() < 2:
        raise NoMatch("hidden has no token dimension")
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1:
        raise NoMatch("targets are not class indices (N,)")
    for name, x, n in (("bias", bias, V), ("class_weight", class_weight, V_out)):
        if x is not None and (_meta(x).dim() != 1 or _meta(x).shape[0] != n):
            raise NoMatch(f"{name} is not a (V,) vector")
    if bias is not None and _meta(bias).dtype not in (h.dtype, w.dtype):
        raise NoMatch("bias dtype differs from hidden and weight")

"""An op's options, declared once: a NamedTuple whose fields are the schema's arguments.

Each op's room (ops/<op>/__init__.py: linear_ce, linear_logprobs, linear_policy_loss,
linear_distillation, linear_soft_ce, linear_sparse_divergence, linear_topk_logprobs)
declares its options as one record, and the ops with several optional per-token tensors
those as another (`tensor_args` writes their schema text). The record gives the schema
its argument list (`schema_args`: names, types and defaults from the fields), travels
as one value through the chunk loop, the row functions and vocab-parallel, and checks
itself (`check()`, the one owner of the options' validation: eager calls, fake kernels
and the lowering pass all call it). A call of an internal op passes the record spread
(`*opts`); its kernel, fake kernel and autograd read it back with `take`. Nothing lists
the options by position but the record's field order.
"""

import collections
import numbers
from typing import Optional, get_type_hints

import torch

_SCHEMA_TYPES = {int: "SymInt", Optional[int]: "int?", float: "float",
                 Optional[float]: "float?", str: "str", Optional[str]: "str?", bool: "bool",
                 Optional[torch.dtype]: "ScalarType?"}


# Schema text writes a dtype default as its c10::ScalarType number.
_SCALAR_TYPES = {torch.float32: "6"}


def _literal(value):
    if value is None:
        return "None"
    if isinstance(value, torch.dtype):
        return _SCALAR_TYPES[value]
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def schema_args(record, defaults=False):
    """The record's fields as a schema's argument list, "float z_loss=0.0, ..." (with
    their defaults when asked: the public ops' keyword arguments)."""
    parts = []
    for name, hint in get_type_hints(record).items():
        arg = f"{_SCHEMA_TYPES[hint]} {name}"
        if defaults and name in record._field_defaults:
            arg += "=" + _literal(record._field_defaults[name])
        parts.append(arg)
    return ", ".join(parts)


def tensor_record(name, *fields):
    """A record of optional tensors (each field None by default), in the schemas' order:
    an op's per-token tensors and optional operands, passed as one value."""
    return collections.namedtuple(name, fields, defaults=(None,) * len(fields))


def tensor_args(record, defaults=False):
    """A record of optional tensors as a schema's arguments, "Tensor? a, Tensor? b"
    (with "=None" when asked: the public ops' arguments)."""
    return ", ".join(f"Tensor? {name}" + ("=None" if defaults else "")
                     for name in record._fields)


def take(record, args):
    """(record, the arguments after it) from an internal op's arguments that begin
    with the spread record."""
    n = len(record._fields)
    return record._make(args[:n]), tuple(args[n:])


def value(cond, msg):
    """Raises ValueError(msg) unless cond; a SymBool is checked without specialising."""
    if isinstance(cond, bool):  # static shapes: a plain raise, which every Dynamo traces
        if not cond:
            raise ValueError(msg)
    else:
        torch._check_with(ValueError, cond, lambda: msg)


def as_float(name, x):
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}") from None


def got(x):
    # While Dynamo traces (dynamic=True) options are symbolic floats, which it cannot
    # format into a message: there the message names the option without its value. The
    # fake kernels, which check options under torch.compile, are not traced by Dynamo.
    return "" if torch.compiler.is_dynamo_compiling() else f", got {x}"


def check_choice(name, x, choices):
    if x not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {x!r}")


def check_bool(name, x):
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def integral(x):
    """x as an int where it is an integral number other than a bool (numpy's integers
    too); anything else as is, for a record's check to refuse by name."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return x


def check_int(name, x):
    if not isinstance(x, (int, torch.SymInt)) or isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")

"""The model exactly as it was: a snapshot of every module's and config's attributes,
the buffers and the RNG streams, restored after the family check's forward."""

import contextlib
import copy

import torch

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
def model_kept(model):
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

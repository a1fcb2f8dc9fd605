"""Registers the fce:: ops: schemas, fake kernels, autograd and per-device kernels."""

from . import schema  # noqa: F401  (defines the ops; must come first)
from . import autograd, cpu, fake, linear_ce, linear_logprobs, linear_policy_loss  # noqa: F401

try:  # the CUDA backend needs Triton; without it CUDA tensors use the PyTorch backend
    import triton  # noqa: F401
except ImportError:
    pass
else:
    from . import cuda  # noqa: F401

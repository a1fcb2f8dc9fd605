"""Registers the fce:: ops. Each op's room (linear_ce, linear_logprobs,
linear_policy_loss, linear_distillation, linear_soft_ce) holds its options, schemas, entry, fake
kernels, autograd and implementation; dispatch.py picks each device's row functions
(docs/design.md)."""

from . import (grads, linear_ce, linear_distillation, linear_logprobs,  # noqa: F401
               linear_policy_loss, linear_soft_ce)

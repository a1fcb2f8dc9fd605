"""The ops, registered on import. Each room (linear_ce, linear_logprobs,
linear_policy_loss, linear_distillation, linear_soft_ce, linear_topk_logprobs,
linear_sparse_divergence) holds one op whole: its options
record, schemas, entry, fake kernels, autograd and implementation. Below the rooms, in
the order they import each other (docs/design.md): machinery/ (the op library, the
backends' dispatch, the autograd helpers), rowmath/ (each family's per-row math, PyTorch
and Triton twins), loop/ (the chunked loop, its workspace and weight-gradient sums),
contract/ (the records' schema text, argument checks, what every entry does)."""

from . import (linear_ce, linear_distillation, linear_logprobs,  # noqa: F401
               linear_policy_loss, linear_soft_ce, linear_sparse_divergence,
               linear_topk_logprobs)
from .machinery import grads  # noqa: F401  (fce::scale_grad)

"""The PyTorch backend: CPU, and the fallback on any device without a faster kernel."""

import torch

from . import chunked
from .rows import torch_rows

# Elements of one logits chunk: a fixed workspace whatever N is (at least one row).
WORKSPACE_ELEMS = 1 << 22


def _chunk_rows(V):
    return max(1, WORKSPACE_ELEMS // max(1, V))


def _check_targets(target, V, ignore_index):
    # Eager-only check; on the CPU it costs no device sync.
    if target.device.type == "cpu":
        bad = (target != ignore_index) & ((target < 0) | (target >= V))
        if bad.any():
            raise IndexError(
                f"target holds {int(target[bad][0])}, outside [0, V) = [0, {V}) and not "
                f"ignore_index ({ignore_index})"
            )


@torch.library.impl("fce::linear_ce_fwd", "CompositeExplicitAutograd")
def linear_ce_fwd(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                  label_smoothing, softcap, z_loss, accumulator, needs_grad):
    _check_targets(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_fwd(
        hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
        softcap, z_loss, accumulator, needs_grad, rows=torch_rows,
        chunk_rows=_chunk_rows(weight.shape[0]))


@torch.library.impl("fce::linear_ce_bwd", "CompositeExplicitAutograd")
def linear_ce_bwd(grad_loss, hidden, weight, target, bias, class_weight, ignore_index,
                  reduction, label_smoothing, softcap, z_loss, accumulator, needs_grad):
    _check_targets(target, weight.shape[0], ignore_index)
    return chunked.linear_ce_bwd(
        grad_loss, hidden, weight, target, bias, class_weight, ignore_index, reduction,
        label_smoothing, softcap, z_loss, accumulator, needs_grad, rows=torch_rows,
        chunk_rows=_chunk_rows(weight.shape[0]))


@torch.library.impl("fce::scale_grad", "CompositeExplicitAutograd")
def scale_grad(grad, scale, dtype):
    return torch.mul(grad, scale, out=grad.new_empty(grad.shape, dtype=dtype))

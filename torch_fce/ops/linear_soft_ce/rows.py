"""The sparse-target cross entropy's rows: -sum_k p_k log q[idx_k] over a few classes
of each row, on the shared sparse rows (rowmath/sparse_rows.py: PyTorch, or its
Triton twin)."""

import torch

from ..loop.chunked import ONE_DEVICE
from ..rowmath.sparse_rows import sparse_rows


def sparse_targets(idx, probs, V, ignore_index, mdt):
    """(skip, valid, safe, p) of a chunk's sparse targets: the entries skipped, the
    tokens counted, the indices made safe to read (skipped and out-of-range ones at 0)
    and the probabilities in mdt (0 where skipped, NaN where the index is outside [0,
    V): that token's loss is NaN)."""
    skip = idx == ignore_index
    bad = ~skip & ((idx < 0) | (idx >= V))
    p = torch.where(skip, 0.0, torch.where(bad, float("nan"), probs.to(mdt)))
    return skip, ~skip.all(-1), torch.where(skip | bad, 0, idx).long(), p


def soft_ce_rows(z, idx, probs, inv_t, weights, opts, mdt, dz_dtype, want_grad,
                 sparse=sparse_rows, shard=ONE_DEVICE):
    """(loss_t, dz) of a chunk's cross entropy to sparse targets: z (n, V) the logits,
    idx and probs (n, k) the targets' classes and probabilities (an index equal to
    opts.ignore_index is skipped, a token with every index skipped not counted), inv_t,
    weights (n,) 1 / T and w_t: loss_t = -w_t sum_k p_k log q[idx_k], so g = -w_t p
    (`sparse`, the backend's sparse_rows, forms dz). An index outside [0, V) makes its
    token's loss NaN (nothing is read out of bounds). A vocabulary shard's: as
    sparse_rows'. Overwrites z where it can."""
    V = z.shape[1] if shard.group is None else shard.vocab_size
    skip, valid, safe, p = sparse_targets(idx, probs, V, opts.ignore_index, mdt)
    w = torch.where(valid, weights, 0.0)[:, None]

    def terms(log_q):
        return -(w[:, 0] * torch.where(skip, 0.0, p * log_q).sum(-1)), -w * p

    (loss_t,), dz = sparse(z, safe, inv_t, terms, mdt, dz_dtype, want_grad, shard=shard)
    return loss_t, dz  # a token not counted has g = 0: dz exactly 0

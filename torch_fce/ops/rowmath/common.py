"""Row-math pieces every op's rows share (PyTorch, on every device): a row sum that
keeps a lone row's bits, the softcap and the logit transform, the first maximum, the
merge of a vocabulary shard's row sums, and RowMath, the record a row function's
workspace needs are read from."""

from typing import Callable, NamedTuple

import torch

from ..loop.chunked import logits_bytes, math_dtype_for


def row_sum(x, keepdim=False):
    """x.sum(-1) of rows of classes, a lone row's too as in a chunk of several: ATen
    splits one row's sum across threads (another summation order), several rows' one
    per thread (batch invariance: a chunk of one token must give its row's bits)."""
    if x.dim() == 2 and x.shape[0] == 1 and not x.is_cuda:
        return x.expand(2, -1).sum(-1, keepdim=keepdim)[:1]
    return x.sum(-1, keepdim=keepdim)


def softcapped(logits, softcap, math_dtype):
    """(z, tanh): the logits in math_dtype after the softcap, and tanh(logits / softcap)
    for its derivative (None without softcap). Overwrites logits where it can."""
    z = logits.to(math_dtype)  # the buffer itself when it already is math_dtype
    if softcap is None:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh


def first_max(c):
    """(max, its first column) of each row of c, as the Triton kernels: a NaN never
    wins (a row of NaN gives -inf at column 0)."""
    c = torch.where(c.isnan(), float("-inf"), c)
    i = c.argmax(-1)
    return c.gather(1, i[:, None]).squeeze(1), i


def capped(z, scale, cap, mdt):
    """(softcap(scale * z) in mdt, d a / d z or None when it is the scale itself)."""
    a = z.to(mdt) * scale
    if cap is None:
        return a, None
    a = torch.tanh(a / cap).mul_(cap)
    return a, (1.0 - (a / cap) ** 2) * scale


def rebased_ez(ez, s, m, m_new):
    """ez = sum_c exp(z_c - m) (z_c - m) relative to a larger max m_new, before the
    exp(m - m_new) scale: 0 for no classes (s = 0), where m - m_new may overflow."""
    return torch.where(s > 0, ez + (m - m_new) * s, 0.0)


def all_reduce_sums(m, s, ez, shard, *more):
    """(M, s, ez, *more) of rows (n,) across the shard group (the collective hook): the
    max, the sum of exps and ez (TileStats') rebased to it, and more tensors of the rows
    summed (one max, one stacked sum)."""
    M = shard.all_reduce(m, "max")
    scale = torch.exp(m - M)
    return (M, *shard.all_reduce(torch.stack([s * scale, rebased_ez(ez, s, m, M) * scale,
                                              *more]), "sum"))


class RowMath(NamedTuple):
    """A row function on one backend, how many float32 (n, V) temporaries it allocates
    beyond the chunk's logits and dz (the workspace's bytes per logit count them) and
    whether it writes dz over wider logits too (kernels.dz_over)."""
    rows: Callable
    temporaries: int
    dz_over: bool = False

    def per_logit(self, logits_dtype, dtype):
        """A chunk's bytes per logit: the logits, the temporaries and dz (in the inputs'
        dtype) where it has a buffer of its own (logits wider than the inputs, unless
        written over them)."""
        return logits_bytes(logits_dtype, logits_dtype if self.dz_over else dtype) + \
            self.temporaries * math_dtype_for(dtype).itemsize

"""Hypothesis strategies for fce::linear_ce problems (shared by the property tests)."""

import torch
from hypothesis import strategies as st

from torch_fce.testing import make_inputs


@st.composite
def problems(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16),
             vocab=(2, 3, 31, 97, 257, 70001)):
    """Returns (inputs dict, options dict) for a random problem with every option."""
    N = draw(st.sampled_from([0, 1, 2, 7, 33]))
    D = draw(st.sampled_from([1, 4, 17, 127]))
    V = draw(st.sampled_from(vocab))
    dtype = draw(st.sampled_from(dtypes))
    master = dtype != torch.float32 and draw(st.booleans())
    x = make_inputs(
        N, D, V, dtype, ignore_frac=draw(st.sampled_from([0.0, 0.2, 1.0])),
        bias=draw(st.booleans()), class_weight=draw(st.booleans()),
        weight_dtype=torch.float32 if master else None, seed=draw(st.integers(0, 2**16)),
        weight_scale=draw(st.sampled_from([1.0, 4.0])),
    )
    if draw(st.booleans()) and N > 0:  # a (B, T) batch shape, B > 1 where N allows
        B = next(b for b in (3, 2, 1) if N % b == 0)
        x["hidden"] = x["hidden"].reshape(B, N // B, D)
        x["target"] = x["target"].reshape(B, N // B)
    options = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        softcap=draw(st.sampled_from([None, 2.0, 30.0])),
        z_loss=draw(st.sampled_from([0.0, 1e-2])),
    )
    return x, options

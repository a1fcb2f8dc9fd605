"""The exp-GEMM pipeline's CUDA twin (exp_gemms.py): quack-kernels' CuTe DSL GEMMs, sm_90.

The logits GEMM is quack's scaled_exp_target_epi as its own pipeline runs it
(quack/linear_cross_entropy.py), or at a per-row inverse temperature this file's
_tempered_exp_epi (the same epilogue on z t, with the entropy's partial); the gradient GEMMs read E through quack's A-operand
transforms (a per-(row, 64 classes) strip for dx, per-(64 classes, row) for dW). The dx
epilogue is this file's: v times the accumulator minus the one-hot and smoothing terms,
in float32, rounded once. The logits GEMM's tiles are fixed (no autotuning), so a row's
sums do not depend on the batch: the per-token outputs stay batch-invariant. The dx
GEMM's tile_N, its splits of V and the chunk's rows are planned for the GPU's SMs
(exp_gemms.wave_plan).
"""

import functools

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import identity_epi
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, RowVecLoad
from quack.epilogue.scaled_exp import LOG2E, MaxLog2, scaled_exp_target_epi
from quack.gemm_interface import SplitKMode
from quack.operand_transform import a_transform
from quack.operand_transform.host import transform_a_operand

from .exp_gemms import ExpTile, wave_plan


@a_transform(vec_size=8, args={"u": "colvec_ktile"})
def _dx_scale(x, u):
    return x * u


@a_transform(vec_size=8, args={"u": "kvec_m64"})
def _dw_scale(x, u):
    return x * u


@gemm_epilogue(ops={"v": ColVecLoad("v"), "b": ColVecLoad("b"), "cs": ColVecLoad("cs"),
                    "r": RowVecLoad("r")})
def _dx_epi(acc, c, v, b, cs, r):
    """v (E u) W - b W[col] - cs r: C is W[col], gathered (bf16 rows, exact)."""
    return {"D": acc * v - c * b - cs * r}


_max_log2_t, _target_t = MaxLog2("max_log2"), ColVecLoad("target")


def _tempered_prepass(acc, inv_t):
    return {"max_log2": acc * inv_t}  # MaxLog2: k = rne(max(z t) log2e)


@gemm_epilogue(
    ops={"max_log2": _max_log2_t, "inv_t": ColVecLoad("inv_t")},
    prepass=_tempered_prepass, prepass_outs=("max_log2",),
    reduces={"sum_exp": ColVecReduce("sum_exp"), "sum_ey": ColVecReduce("sum_ey")},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_target_t)},
    extra_ops=(_max_log2_t.out("max_log2_out"), _target_t))
def _tempered_exp_epi(acc, max_log2, inv_t):
    """scaled_exp_target_epi on z t (the twin's order: (z t) log2e - k), and sum_ey."""
    y = acc * inv_t * LOG2E - max_log2
    e = pexp2(y)
    return {"D": e, "sum_exp": e, "sum_ey": e * y, "target_logit": acc}


def _dw_tile_n(D):
    """The dW GEMM's tile_N over D: quack's 192 where it divides D, else the first of
    256 and 224 that does (D 896: 224, on an H100 the step 2.8% faster than quack's
    256, whose last tile is half padding), else 256."""
    return next((n for n in (192, 256, 224) if D % n == 0), 256)


@functools.cache
def _sms(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(N, D, V, rows, device):
    """exp_gemms.plan on the GPU: exp_gemms.wave_plan for its SMs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return wave_plan(N, D, V, rows, _sms(index))


def logits(x, w, col, tile_n, E, inv_t=None):
    """exp_gemms.logits on the GPU."""
    M, V = x.shape[0], w.shape[0]
    T = V // tile_n
    sum_exp, k = (x.new_empty(M, T, dtype=torch.float32) for _ in range(2))
    zy = x.new_zeros(M, dtype=torch.float32)
    args = dict(max_log2=tile_n, sum_exp=sum_exp, max_log2_out=k, target=col, target_logit=zy)
    sum_ey = None
    if inv_t is None:
        epi = scaled_exp_target_epi
    else:
        epi, sum_ey = _tempered_exp_epi, x.new_empty(M, T, dtype=torch.float32)
        args.update(inv_t=inv_t, sum_ey=sum_ey)
    epi.gemm(x, w, E, epi_args=args, tile_M=128, tile_N=tile_n, cluster_M=2, cluster_N=1,
             pingpong=tile_n <= 208)
    return ExpTile(E, sum_exp, k, zy, sum_ey)


def dx(g, w, r, out, tiles):
    """exp_gemms.dx on the GPU, at the plan's DxTiles (serial splits: in split order)."""
    bundle = transform_a_operand(_dx_scale, g.E, {"u": g.u}, 128, 64)
    wy = w[g.col.clamp_min(0)]
    _dx_epi.gemm(bundle, w.mT, out, wy, epi_args=dict(v=g.v, b=g.b, cs=g.cs, r=r),
                 transform_a=_dx_scale, tile_M=128, tile_N=tiles.tile_n,
                 tile_K=64, cluster_M=2, cluster_N=1, split_k=tiles.split,
                 split_k_mode=SplitKMode.SERIAL)


def dw_add(g, x, dw, first):
    """exp_gemms.dw_add on the GPU: later chunks add through the TMA reduce-add store."""
    bundle = transform_a_operand(_dw_scale, g.E.t(), {"u": g.uv}, 128, 64)
    identity_epi.gemm(bundle, x.mT, dw, epi_args={}, transform_a=_dw_scale,
                      add_to_output=not first, tile_M=128, tile_N=_dw_tile_n(x.shape[1]),
                      tile_K=64, cluster_M=1, cluster_N=2)

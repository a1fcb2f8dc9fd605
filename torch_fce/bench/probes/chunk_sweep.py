"""The whole op's step (cross entropy, forward+backward, as the benchmark times it) at a
range of chunk sizes, per shape: which token chunks cuBLAS's kernel choices favour.

chunk_breakdown.py times the loop's steps at the default chunk and at 4096 and 8192
rows; this times the op itself, back to back (the sustained regime the benchmark
measures), at each chunk in PROBE_ROWS (default below), in x mm and with the logits
workspace it holds.

    PROBE_ROWS=3456,4096 python torch_fce/bench/probes/chunk_sweep.py D E Q1024 Q2048
"""

import os

import torch

import torch_fce
from torch_fce.bench.peers import methods, run_step
from torch_fce.bench.shapes import SHAPES, shape_inputs
from torch_fce.ops.loop.workspace import chunk_rows

from torch_fce.bench.probes._common import ms, run_shapes

ROWS = [int(r) for r in os.environ.get(
    "PROBE_ROWS", "2560,3072,3456,3840,4096,4608,5120,6144,8192").split(",")]


def probe_shape(name):
    x = shape_inputs(SHAPES[name])
    h, w = x["hidden"], x["weight"]
    N, D = h.shape
    V = w.shape[0]
    mm = ms(lambda: torch.mm(h, w.t()))
    fce = methods("cuda", False)["fce-fp32"]
    default = chunk_rows(N, V, D, h.dtype, h.device)
    print(f"{name} ({N}x{D}x{V}), mm {mm:.2f} ms, default chunk {default} rows")
    for rows in sorted(set(ROWS + [default])):
        nbytes = rows * V * h.element_size()
        with torch_fce.workspace(nbytes):
            t = ms(lambda: run_step(fce, x))
        print(f"  {rows:5d} rows ({nbytes / 2**20:6.0f} MiB): {t:7.2f} ms = {t / mm:.3f} x mm"
              + ("  <- default" if rows == default else ""))


if __name__ == "__main__":
    run_shapes(probe_shape)

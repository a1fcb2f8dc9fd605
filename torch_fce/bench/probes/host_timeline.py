"""What the host does before the op queues its first logits GEMM.

op_profile.py reports the GPU waiting for the host before the first GEMM; this traces
the Python calls (sys.setprofile) of one step, after warm-up, up to the first F.linear,
and prints each call that took long enough, indented by depth (times include the
tracer's own overhead, so compare them with each other).

    PROBE_OBJECTIVE=ce|logprobs python torch_fce/bench/probes/host_timeline.py D [min_us]
"""

import os
import sys
import time

import torch

from torch_fce.bench import rl
from torch_fce.bench.peers import methods, run_step
from torch_fce.bench.shapes import SHAPES, shape_inputs

from torch_fce.bench.probes._common import first_linear

OBJECTIVE = os.environ.get("PROBE_OBJECTIVE", "ce")


def main(name, min_us=10.0):
    fns = methods("cuda", False) if OBJECTIVE == "ce" else rl.methods(OBJECTIVE, "cuda", False)
    x = shape_inputs(SHAPES[name])
    step = lambda: run_step(fns["fce-fp32"], x)  # noqa: E731
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    calls, open_calls = [], []

    def tracer(frame, event, arg):
        if first.host is not None:
            return
        now = time.perf_counter()
        if event in ("call", "c_call"):
            where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
            what = frame.f_code.co_name if event == "call" else \
                f"[C] {getattr(arg, '__qualname__', arg)}"
            open_calls.append((now, len(open_calls), f"{what} ({where})", len(calls)))
            calls.append(None)
        elif open_calls:
            start, depth, what, i = open_calls.pop()
            calls[i] = (start, now - start, depth, what)

    with first_linear() as first:
        t0 = time.perf_counter()
        sys.setprofile(tracer)
        try:
            step()
        finally:
            sys.setprofile(None)
    print(f"{name} {OBJECTIVE}: the first F.linear after {(first.host - t0) * 1e6:.0f} us "
          f"(traced)")
    for start, depth, what, i in open_calls:  # still running at the first F.linear
        calls[i] = (start, first.host - start, depth, what + " [open]")
    for c in calls:
        if c is not None and c[1] * 1e6 >= min_us:
            print(f"{(c[0] - t0) * 1e6:8.0f} {c[1] * 1e6:7.0f} us {'  ' * c[2]}{c[3]}")


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    main(sys.argv[1] if len(sys.argv) > 1 else "D",
         float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)

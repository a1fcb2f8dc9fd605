"""Where the op's forward+backward time goes beyond the chunk loop's kernels.

chunk_breakdown.py times the loop's four steps with CUDA events; the op as the benchmark
calls it takes longer. This profiles one fce-fp32 step per shape and prints the GPU
time of each kernel kind, their sum and the step's wall time: the difference is time
the GPU waits for the host.

    python benchmarks/probes/op_profile.py      # needs one CUDA GPU
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import torch_fce
from torch_fce.bench.shapes import SHAPES, shape_inputs

from _common import run_shapes


def _step(x):
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()
    torch_fce.linear_cross_entropy(h, w, x["target"]).backward()


def probe_shape(name):
    shape = SHAPES[name]
    x = shape_inputs(shape)
    for _ in range(2):
        _step(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    _step(x)
    end.record()
    host = (time.perf_counter() - t0) * 1e3  # the host's own time: no sync inside
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    print(f"{name}: host returns after {host:.2f} ms, GPU span {start.elapsed_time(end):.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(x)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name[:60]
            n, us = kernels.get(key, (0, 0.0))
            kernels[key] = (n + 1, us + e.device_time)
    busy = sum(us for _, us in kernels.values()) / 1e3
    print(f"{name}: wall {wall:.2f} ms, GPU busy {busy:.2f} ms, idle {wall - busy:.2f} ms")
    for key, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {us / 1e3:8.3f} ms  x{n:<3d} {key}")
    # The GPU's idle gaps of 20 us or more, between which kernels.
    gpu = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    for (s0, e0, n0), (s1, _, n1) in zip(gpu, gpu[1:]):
        if s1 - e0 >= 20:
            print(f"  gap {(s1 - e0) / 1e3:6.3f} ms after {n0} before {n1}")


if __name__ == "__main__":
    run_shapes(probe_shape)

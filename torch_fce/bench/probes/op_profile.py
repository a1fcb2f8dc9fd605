"""Where the op's forward+backward time goes beyond the chunk loop's kernels.

chunk_breakdown.py times the loop's four steps with CUDA events; the op as the benchmark
calls it takes longer. This profiles one step per shape of the benchmark's methods
(PROBE_OBJECTIVE=ce, logprobs or policy; PROBE_METHODS, default fce-fp32; the sweep's
fce-fp32@MiB, fce-exp and torch.compile too) and prints the
GPU time of each kernel kind, their sum and the step's wall time: the difference is
time the GPU waits for the host.

    python torch_fce/bench/probes/op_profile.py A B      # needs one CUDA GPU
    PROBE_OBJECTIVE=logprobs PROBE_METHODS=fce-fp32,trl-head python op_profile.py D

PROBE_HOST=1 also prints cProfile's view of the host's Python during ten steps.
PROBE_TRACE_DIR=dir also profiles the host and writes each step's Chrome trace there
(host op, launch and kernel), to find what the host does while the GPU waits.
"""

import cProfile
import os
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torch_fce.bench import rl
from torch_fce.bench.peers import SWEEP_WORKSPACE_MIB, methods, run_step
from torch_fce.bench.shapes import SHAPES, shape_inputs

from torch_fce.bench.probes._common import first_linear, ms, run_shapes

OBJECTIVE = os.environ.get("PROBE_OBJECTIVE", "ce")
TRACE_DIR = os.environ.get("PROBE_TRACE_DIR")
HOST = os.environ.get("PROBE_HOST") == "1"
METHODS = os.environ.get("PROBE_METHODS", "fce-fp32").split(",")


def probe_shape(name):
    compiled = any(m.startswith("torch.compile") for m in METHODS)
    fns = methods("cuda", compiled, SWEEP_WORKSPACE_MIB) if OBJECTIVE == "ce" else \
        rl.methods(OBJECTIVE, "cuda", compiled, SWEEP_WORKSPACE_MIB)
    x = shape_inputs(SHAPES[name])
    if OBJECTIVE == "policy":
        x["data"] = rl.policy_data(x["hidden"], x["weight"], x["target"])
    for method in METHODS:
        print(f"{name} {OBJECTIVE} {method}:")
        _profile(lambda: run_step(fns[method], x), f"{name}_{OBJECTIVE}_{method}")


def _profile(_step, tag):
    for _ in range(2):
        _step()
    torch.cuda.synchronize()
    print(f"  step {ms(_step):.2f} ms (median of 10)")
    rested = []
    for _ in range(5):  # the GPU idle for 0.5 s first: clocks up after a sustained run
        time.sleep(0.5)
        t0 = time.perf_counter()
        _step()
        torch.cuda.synchronize()
        rested.append(time.perf_counter() - t0)
    print(f"  step after 0.5 s idle {sorted(rested)[2] * 1e3:.2f} ms (median of 5)")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with first_linear() as first:
        t0 = time.perf_counter()
        start.record()
        _step()
        end.record()
        host = (time.perf_counter() - t0) * 1e3  # the host's own time: no sync inside
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    print(f"  host returns after {host:.2f} ms, GPU span {start.elapsed_time(end):.2f} ms, "
          f"of which before the first logits GEMM {start.elapsed_time(first.event):.2f} ms "
          f"(the host queues it after {(first.host - t0) * 1e3:.2f} ms)")
    if HOST:
        with cProfile.Profile() as host_prof:
            for _ in range(10):
                _step()
                torch.cuda.synchronize()
        stats = pstats.Stats(host_prof)
        stats.sort_stats("tottime").print_stats(20)
        stats.sort_stats("cumulative").print_stats(40)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if TRACE_DIR else [])
    with profile(activities=activities) as prof:
        _step()
        torch.cuda.synchronize()
    if TRACE_DIR:
        os.makedirs(TRACE_DIR, exist_ok=True)
        prof.export_chrome_trace(os.path.join(TRACE_DIR, f"{tag}.json"))
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name[:60]
            n, us = kernels.get(key, (0, 0.0))
            kernels[key] = (n + 1, us + e.device_time)
    busy = sum(us for _, us in kernels.values()) / 1e3
    print(f"  wall {wall:.2f} ms, GPU busy {busy:.2f} ms, idle {wall - busy:.2f} ms")
    for key, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {us / 1e3:8.3f} ms  x{n:<3d} {key}")
    # The GPU's idle gaps of 20 us or more, between which kernels.
    gpu = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = [s1 - e0 for (_, e0, _), (s1, _, _) in zip(gpu, gpu[1:])]
    print(f"  first kernel to last: {(gpu[-1][1] - gpu[0][0]) / 1e3:.2f} ms, all gaps "
          f"{sum(g for g in gaps if g > 0) / 1e3:.2f} ms, of 20 us or more "
          f"{sum(g for g in gaps if g >= 20) / 1e3:.2f} ms")
    for (s0, e0, n0), (s1, _, n1) in zip(gpu, gpu[1:]):
        if s1 - e0 >= 20:
            print(f"  gap {(s1 - e0) / 1e3:6.3f} ms after {n0} before {n1}")


if __name__ == "__main__":
    run_shapes(probe_shape)

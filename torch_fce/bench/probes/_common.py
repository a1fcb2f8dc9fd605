"""What the probes share: timing, per-kernel profiles, the first logits GEMM's mark, plain
cross-entropy row options, grouped tile order."""

import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch_fce.bench.measure import median_time
from torch_fce.ops.linear_ce import CEOptions
from torch_fce.ops.linear_ce.kernels import triton_ce_stats_then_grad

OPTS = CEOptions()  # plain cross entropy, ignore_index -100


def ce_row_grad(z, t, ce, zs):
    """The op's Triton row kernel on a logits chunk z: dz written over z (returned)."""
    return triton_ce_stats_then_grad(z, t, None, (ce, zs), OPTS, False, torch.float32)[1]


def run_shapes(probe_shape):
    """Prints the machine and versions, then runs probe_shape on the benchmark shapes named
    on the command line (default A, B, C)."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    for name in sys.argv[1:] or "ABC":
        probe_shape(name)
        torch.cuda.empty_cache()  # the shape's tensors died with the call


class first_linear:
    """`with first_linear() as first:` marks where the block queues its first F.linear
    (the loop's first logits GEMM): first.host, the host's perf_counter then, and
    first.event, a CUDA event the GPU reaches once it has run the work queued before."""

    def __enter__(self):
        self.linear, self.host, self.event = F.linear, None, None

        def linear(*args, **kwargs):
            if self.host is None:
                self.host = time.perf_counter()
                self.event = torch.cuda.Event(enable_timing=True)
                self.event.record()
            return self.linear(*args, **kwargs)
        F.linear = linear
        return self

    def __exit__(self, *exc):
        F.linear = self.linear


def profile_steps(fns, cpu=False, row_limit=16, width=60):
    """Per-kernel CUDA time of three steps of each fn of fns (name -> step, after two
    warm-up steps), the profiler's table sorted by it; cpu: the host's ops too."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    for name, f in fns.items():
        f(), f()
        torch.cuda.synchronize()
        with profile(activities=activities) as p:
            for _ in range(3):
                f()
            torch.cuda.synchronize()
        print(f"  {name} (3 steps):")
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=row_limit,
                                     max_name_column_width=width), flush=True)


def ms(fn):
    """Median milliseconds of fn() on CUDA (10 runs after 2 warm-ups)."""
    return median_time(fn, "cuda", reps=10, warmup=2) * 1e3


@triton.jit
def tile_pid(tile, per_group, num_pid_m, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a persistent GEMM's tile: GROUP_M row tiles share column tiles
    in L2 (the Triton tutorials' grouped order)."""
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % per_group) // size_m


@triton.jit
def at_b_tile(a_desc, b_desc, pid_m, pid_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Tile (pid_m, pid_n) of A.T @ B in float32, for A (K, M) and B (K, N) read through
    TMA descriptors of (BLOCK_K, BLOCK_M) and (BLOCK_K, BLOCK_N) blocks (dz.T @ h)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([k * BLOCK_K, pid_m * BLOCK_M])
        b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
        acc = tl.dot(a.T, b, acc)
    return acc

"""Time and peak-memory measurement for the main job and the benchmarks.

CUDA: the caching allocator's peak. CPU: the process's resident-set high-water mark
(Linux), with glibc told to serve every allocation of 64 KiB or more by mmap so freed
tensors leave the resident set at once instead of lingering in malloc's heap. Memory
freed to malloc's heap before the first measurement (or before `prepare`) can still be
reused unseen, so CPU figures are meant for fresh processes (the benchmarks and the main
job) and are not resolved below about a MiB (`CPU_RESOLUTION`).

That malloc slows what it measures: every chunk-sized buffer is a fresh mmap whose pages
fault in on each use (on a 2-core EPYC, 2026-12-08, the main job's torch_fce step about
0.5 s at glibc's defaults, 0.65 s so, the unfused one's 3% slower:
docs/data/raw/cpu_malloc_threshold_b7e4295_9726519.txt). The main job times its steps in
`users_allocator`, once every memory figure is taken (the heap a timing leaves hides
memory from a later figure); the benchmarks' CPU timings, taken between their memory
figures, run at the pinned threshold.
"""

import contextlib
import ctypes
import functools
import gc
import os
import statistics
import time

import torch

import torch_fce

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
# glibc's own: the thresholds it starts at (128 KiB both) and the most its dynamic mmap
# threshold rises to on a 64-bit machine (freeing a large mmapped block raises it to the
# block's size, up to 32 MiB, and the trim threshold to twice that)
_GLIBC_START, _GLIBC_MMAP_MAX = 128 << 10, 32 << 20
_PINNED = 1 << 16  # the memory figures' threshold
# Below this a CPU peak is within what the heap and the page granularity hide.
CPU_RESOLUTION = 1 << 20


def with_context(fn, context):
    """fn for a benchmark step whose forward and backward both run inside context()
    (peers.run_step): the backward's backend and workspace are chosen when it runs."""
    def run(*args):
        return fn(*args)
    run.context = context
    return run


def with_workspace(fn, mib):
    """fn for the time-memory sweep, torch_fce's logits workspace at mib MiB around the
    forward and the backward (whose recomputation must cut the logits as the forward
    did)."""
    return with_context(fn, lambda: torch_fce.workspace(mib << 20))


@contextlib.contextmanager
def backend(name):
    """TORCH_FCE_BACKEND=name (docs/api.md) for the block only."""
    previous = os.environ.get("TORCH_FCE_BACKEND")
    os.environ["TORCH_FCE_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FCE_BACKEND")
        else:
            os.environ["TORCH_FCE_BACKEND"] = previous


# Inductor's own chunker (torch >= 2.10), which chunks an unfused loss inside the
# compiled graph: the Inductor options that turn it on
AUTO_CHUNKER = {"auto_chunker.enable": True}


def has_auto_chunker():
    import torch._inductor.config as inductor_config
    return hasattr(inductor_config, "auto_chunker")


def compiled(fn):
    """torch.compile of an unfused loss, as is ("torch.compile") and under Inductor's own
    chunker ("torch.compile-chunker", where torch has it), each with a compile cache of
    its own."""
    out = {"torch.compile": torch.compile(fn, fullgraph=True)}
    if has_auto_chunker():
        def chunked(*args):  # a code object of its own: Dynamo caches by code
            return fn(*args)
        out["torch.compile-chunker"] = torch.compile(chunked, fullgraph=True,
                                                     options=AUTO_CHUNKER)
    return out


def add_device_option(parser):
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when available)")


def add_size_options(parser, **sizes):
    """An integer option --NAME per NAME=(default, help)."""
    for name, (default, what) in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default,
                            help=f"{what} (default: {default})")


def check_device(parser, device):
    """Exits with a usage error naming --device unless torch can run on it."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # a CPU build raises AssertionError
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        parser.error(f"--device {device}: this torch ({torch.__version__}) cannot use it "
                     f"({why})")


def prepare(device):
    """Before any work a CPU figure will compare: large allocations through mmap from
    now on, so that memory freed by earlier work cannot be reused unseen."""
    if torch.device(device).type == "cpu":
        _pin_mmap_threshold()


def measured(peak_bytes, device):
    """Whether a peak_extra_bytes figure is above the measurement's resolution."""
    return torch.device(device).type == "cuda" or peak_bytes >= CPU_RESOLUTION


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: figures may then miss memory reused from the heap
        return None


_pinned = False  # whether this process's malloc serves the memory figures


def _pin_mmap_threshold():
    """Large CPU allocations through mmap, so that their pages leave the resident set
    when freed and VmHWM sees each measured allocation anew. Set by `prepare` or the
    first CPU measurement (not at import: importing a tool changes nothing in the
    process)."""
    global _pinned
    if _libc() is not None and not _pinned:
        _libc().mallopt(_M_MMAP_THRESHOLD, _PINNED)
        _pinned = True


@contextlib.contextmanager
def users_allocator(device):
    """The block's CPU allocations served as in a user's process: where the memory
    figures pinned malloc's mmap threshold, the block runs at the state glibc's dynamic
    threshold settles in once large blocks have been freed (its 32 MiB ceiling, trim at
    twice that), so buffers up to 32 MiB come from the heap (reused once it holds freed
    ones of their size) instead of being mapped and faulted in anew each time. After it
    the threshold is pinned again; the heap the block grew stays (its free blocks serve
    later allocations unseen), so no memory figure should follow in the process."""
    if torch.device(device).type != "cpu" or not _pinned:
        yield
        return
    libc = _libc()
    libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_MAX)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _PINNED)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_START)


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(fn, device):
    """Peak memory fn() allocates beyond what is live when it starts, in bytes."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    _pin_mmap_threshold()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark VmHWM to the current RSS
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) * 1024


def times(fn, device, reps=5, warmup=1):
    """Wall times of reps calls of fn() in seconds (device-synchronised), after warmup."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def median_time(fn, device, reps=5, warmup=1):
    """Median wall time of fn() in seconds (device-synchronised)."""
    return statistics.median(times(fn, device, reps, warmup))

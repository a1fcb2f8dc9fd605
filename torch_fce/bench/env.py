"""The machine and versions a benchmark ran on (every figure in docs/ names them)."""

import os
import platform
import subprocess

import torch


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.machine()
    return f"{model}, {torch.get_num_threads()} threads"


def environment():
    # TORCH_FCE_GIT_SHA names the commit where the checkout has no usable git metadata.
    sha = os.environ.get("TORCH_FCE_GIT_SHA", "")
    try:
        sha = sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(device=gpu, torch=torch.__version__, triton=triton_version, git=sha,
                python=platform.python_version())


def describe(env):
    """One readable line for an environment() record."""
    return (f"{env['device']}, torch {env['torch']}, triton {env['triton']}, "
            f"Python {env['python']}, git {env['git'] or 'unknown'}")

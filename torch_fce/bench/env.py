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


def _commit():
    """torch_fce's own commit: git in the checkout holding this package (a source tree
    or an editable install), never the caller's current directory, which may be another
    repository; '' for an installed copy or without git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "--short",
                              "HEAD"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    lines = out.split()
    if len(lines) == 2 and os.path.realpath(lines[0]) == os.path.realpath(root):
        return lines[1]
    return ""


def environment():
    # TORCH_FCE_GIT_SHA names the commit where the checkout has no usable git metadata.
    sha = os.environ.get("TORCH_FCE_GIT_SHA", "") or _commit()
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

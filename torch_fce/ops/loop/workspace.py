"""The logits workspace: how many token rows one chunk of the loop holds.

Memory and time trade here. One chunk of n rows holds n x V logits (their gradient is
written over them); every chunk after the first re-reads and re-writes the float32
weight-gradient sum (8VD bytes) and launches its GEMMs again, so fewer, larger chunks
are faster (docs/benchmarks.md has the measured curve). The tokens are cut into as
many chunks as the workspace needs, of equal rows.

Default: on CUDA, twice the head's size in the input dtype (the float32 gradient sum is
that size already), at least 1 GiB or 4096 rows, whichever is smaller (4096-row GEMMs
are already efficient, and a small head's chunk then stays well below its logits), at
most 4 GiB or 1/16 of the GPU's memory (that cap wins on GPUs under 16 GiB), and at
most half the logits (so the op saves memory also when all of them would fit). An op
without a weight gradient (the teacher's top-k) has no float32 sum to match, so its
default is the floor alone, times its scale (measured on an H200, docs/distillation.md:
the top-k at 1.25 GiB, not twice a 4096-wide head: at k = 64 and 128 3-7% faster
than at 1 GiB, at k = 8 alike); on
other devices 2^22 elements or 256 rows, whichever is more (smaller chunks re-read the
float32 sum so often that a 2-core CPU ran 5-14% slower at 131 rows).
The log-prob family (log-probs, policy loss) is bounded further on CUDA: its peak within
a float32 weight-gradient sum plus 256 MiB, what a vocabulary-tiled head holds (TRL's
fused head among them), so its chunk is that less the float32 sums it keeps beside the
chunk (`held`): with token chunks the weight-gradient sum's excess over the gradient,
with vocabulary tiles the hidden gradient's. Measured on an H200 (docs/benchmarks.md):
it costs the policy loss up to 13% of its time on the smallest heads (still faster than
TRL's head) and the log-probs none beyond the runs' noise.
The distillation's chunk holds two float32 logits and dz, five times a bf16 cross
entropy's bytes per logit: its CUDA default is 1.5 times the loop's (measured on an H200,
docs/distillation.md: 6% faster than the loop's on a 1024-wide student, its peak still
below TRL's kernel's). The sparse divergence's chunk holds float32 logits with dz over
them: its default is 3/4 of the loop's (measured there: its time unchanged within the
runs' noise, its peak down by 220 MiB to 1/10 of the compiled composition's).
`set_workspace(nbytes)` or the TORCH_FCE_WORKSPACE_MB environment variable replace the
default on every device, with no half-the-logits cap.

The log-probs with fewer tokens than classes cut the same bytes along the vocabulary
(chunked.by_vocab): what they re-read per tile is a float32 sum of the hidden gradient
(N x D), so more tiles cost little there. Their backward recomputes the logits; set a
workspace around forward and backward alike, so that it cuts them as the forward did.
"""

import contextlib
import functools
import os

import torch

_GIB = 1 << 30
_OTHER_DEVICE_ELEMS = 1 << 22
_OTHER_DEVICE_ROWS = 256
_MIN_CHUNKS = 2
_FLOOR_ROWS = 4096
_TILE_BYTES = 256 << 20  # the log-prob family's peak beyond a float32 weight-gradient sum

def _from_env():
    value = os.environ.get("TORCH_FCE_WORKSPACE_MB")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"TORCH_FCE_WORKSPACE_MB must be a positive integer (MiB), "
                         f"got {value!r}")
    return int(value) << 20


_nbytes = _from_env()


def set_workspace(nbytes):
    """Sets the bytes of one logits chunk for every later call (None: the default).

    Returns the previous setting. Read when a kernel runs, so a captured CUDA graph
    keeps the chunking it was captured with.
    """
    global _nbytes
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 1):
        raise ValueError(f"nbytes must be None or a positive int, got {nbytes!r}")
    previous, _nbytes = _nbytes, nbytes
    return previous


@contextlib.contextmanager
def workspace(nbytes):
    """`with torch_fce.workspace(2 << 30):` sets the workspace for the block only."""
    previous = set_workspace(nbytes)
    try:
        yield
    finally:
        set_workspace(previous)


@functools.cache
def _total_memory(device):  # the driver query costs the host more than the op's checks
    return torch.cuda.get_device_properties(device).total_memory


def _default_cuda_bytes(V, D, itemsize, device, scale=1.0, weight_grad=True):
    cap = min(4 * _GIB, _total_memory(device) // 16)
    floor = min(_GIB, _FLOOR_ROWS * V * itemsize)
    head = 2 * V * D * itemsize if weight_grad else 0
    return min(cap, int(scale * max(floor, head)))


def chunk_rows(N, V, D, dtype, device, per_logit=None, held=None, scale=1.0,
               weight_grad=True):
    """Rows per chunk for N tokens, V classes (this rank's, for a vocabulary shard) and
    hidden size D, inputs of dtype and per_logit bytes per logit of the chunk (None:
    dtype's; float32 logits of bfloat16 inputs hold 4 + 2 with their gradient); at
    least one row. held: the log-prob family's float32 sums beside the chunk, in bytes
    (None: not that family). scale: the op's CUDA default as a multiple of the loop's,
    within the same cap. weight_grad=False: an op without a weight gradient (the
    top-k's), whose CUDA default is the floor alone. Chunks are balanced (as many as the workspace needs, of equal
    rows); CUDA chunks are a multiple of 128 rows (GEMM tiles) unless that is below one
    tile."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_logit = per_logit or itemsize
    cuda = device.type == "cuda"
    if _nbytes is not None:
        rows = _nbytes // (V * per_logit)
    elif cuda:
        nbytes = _default_cuda_bytes(V, D, itemsize, device, scale, weight_grad)
        if held is not None:
            nbytes = min(nbytes, max(_TILE_BYTES, 4 * V * D + _TILE_BYTES - held))
        rows = min(nbytes // (V * per_logit), -(-N // _MIN_CHUNKS))
    else:
        rows = max(_OTHER_DEVICE_ELEMS * itemsize // (V * per_logit), _OTHER_DEVICE_ROWS)
    rows = int(rows)  # per_logit may be fractional (exp_gemms.BYTES_PER_LOGIT)
    if cuda and rows >= 128:
        rows = rows // 128 * 128
    rows = max(1, rows)
    if N:  # balanced: as many chunks as the workspace needs, of equal rows (a thin last
        # one re-reads the float32 sum as a full one does, for few tokens)
        even = -(-N // -(-N // rows))
        rows = -(-even // 128) * 128 if cuda and rows >= 128 else even
    return rows

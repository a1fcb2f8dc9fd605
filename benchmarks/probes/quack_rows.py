"""Is quack's two-move cross-entropy row kernel faster than torch_fce's, on one chunk?

torch_fce's Triton row kernel (ops/triton/rows.py) reads each logit twice and writes it
once. quack's CuTe kernel `quack.cross_entropy.cross_entropy_fwd_out`, which quack's base
pipeline (quack.linear_cross_entropy.chunked_linear_cross_entropy_fwd) calls with dx = the
logits, splits a row over a cluster of CTAs (16 for V = 151936 bf16 on sm90), keeps it in
shared memory and registers, and reads and writes each logit once.

On one chunk of rows at the chunk size the CUDA backend picks (ops.workspace.chunk_rows,
as chunk_breakdown), per shape named on the command line (default A, B, C; the small
heads are D and E), it times, in ms and x (a):
  (a) the chunk's cuBLAS logits GEMM, hidden[:n] @ W.T into the chunk's buffer;
  (b) torch_fce's row kernel, triton_rows with the per-row scale 1/N (as chunk_breakdown);
  (c) quack's kernel writing loss, lse and dlogits over the logits (in place).
Each time is the median of 10 runs (after 2 warm-ups) of INNER back-to-back calls, divided
by INNER. The row kernels write in place, so each call after the first reads the previous
call's dlogits (finite, in [-1, 1]); that moves the same bytes. Then, from fresh logits, it
prints the max |difference| between quack's dlogits and ours. quack writes softmax - onehot
with no scale, so ours is multiplied by N first. It also prints each against a float32
softmax - onehot, and the lse and per-row loss differences.

On the device, with quack importable (../shared/peers/README.md, the two-call recipe):
    source .peers/setup.sh
    PYTHONPATH=.:$PYTHONPATH python benchmarks/probes/quack_rows.py D E
"""

import sys
import time

import torch

from torch_fce.bench.shapes import SHAPES, shape_inputs
from torch_fce.ops.workspace import chunk_rows
from torch_fce.ops.triton.rows import triton_rows

from _common import OPTS, ms, run_shapes

INNER = 4  # calls per timed run, so the host's launch latency hides behind the kernels
IGNORE = OPTS.ignore_index  # -100, the value of shape_inputs' ignored targets


def quack_fwd_out():
    """quack.cross_entropy.cross_entropy_fwd_out, or exits saying why it cannot load."""
    try:
        from quack.cross_entropy import cross_entropy_fwd_out
    except Exception as e:  # not installed, or no CUDA 13 runtime for cutlass-dsl
        sys.exit(f"quack_rows: cannot import quack.cross_entropy "
                 f"({type(e).__name__}: {e}).\nOn the device: unpack cutlass-dsl to "
                 "/tmp/cutlass, then `source .peers/setup.sh` (../shared/peers/README.md).")
    return cross_entropy_fwd_out


def _timed(step):
    """Milliseconds of one step() (median over runs of INNER calls)."""
    return ms(lambda: [step() for _ in range(INNER)]) / INNER


def _errors(z0, t, dz_ours, scale_ours, dz_quack, block=256):
    """Max |.| of (ours - quack, ours - ref, quack - ref) in softmax - onehot units, ref
    the float32 softmax of the bf16 logits z0 minus onehot(t), 0 on ignored rows."""
    errs = [0.0, 0.0, 0.0]
    for s in range(0, z0.shape[0], block):
        ref = torch.softmax(z0[s:s + block].float(), dim=-1)
        tt = t[s:s + block]
        rows = torch.nonzero(tt != IGNORE).squeeze(1)
        ref[rows, tt[rows]] -= 1.0
        ref[tt == IGNORE] = 0.0
        ours = dz_ours[s:s + block].float() / scale_ours
        theirs = dz_quack[s:s + block].float()
        for i, d in enumerate((ours - theirs, ours - ref, theirs - ref)):
            errs[i] = max(errs[i], d.abs().max().item())
    return errs


def probe_shape(name, fwd_out):
    """Probes one shape on one chunk; its tensors are freed on return."""
    shape = SHAPES[name]
    N, D, V = shape.N, shape.D, shape.V
    x = shape_inputs(shape)
    h, w, t = x["hidden"], x["weight"], x["target"]
    n = chunk_rows(N, V, D, torch.bfloat16, "cuda")
    hc, tc = h[:n], t[:n].contiguous()
    z = torch.empty(n, V, device="cuda", dtype=h.dtype)
    ce, zs = torch.full((n,), 1.0 / N, device="cuda"), torch.zeros(n, device="cuda")
    loss, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")

    def logits():
        torch.mm(hc, w.t(), out=z)

    def ours():
        triton_rows(z, tc, None, ce, zs, OPTS, torch.float32)

    def quack(buf=z):
        # As chunked_linear_cross_entropy_fwd, with lse as well: dlogits over the logits.
        fwd_out(buf, tc, None, loss=loss, lse=lse, dx=buf, weight=None,
                ignore_index=IGNORE)

    logits()
    t0 = time.perf_counter()
    quack()  # JIT-compiles for this V (or loads QUACK_CACHE_DIR's object)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    mm = _timed(logits)
    logits()
    ours_ms = _timed(ours)
    logits()
    quack_ms = _timed(quack)
    gb = n * V * z.element_size() / 1e9
    print(f"{name} ({N}x{D}x{V}), chunk {n} rows ({gb:.2f} GB of logits), quack's first "
          f"call {compile_s:.1f} s", flush=True)
    print(f"  (a) logits mm {mm:.3f} ms | (b) Triton rows {ours_ms:.3f} ms = "
          f"{ours_ms / mm:.3f} x (a), {3 * gb / ours_ms:.2f} TB/s for 2 reads + 1 write | "
          f"(c) quack rows {quack_ms:.3f} ms = {quack_ms / mm:.3f} x (a), "
          f"{2 * gb / quack_ms:.2f} TB/s for 1 read + 1 write | (c)/(b) "
          f"{quack_ms / ours_ms:.3f}", flush=True)

    logits()
    z_ours, z_quack = z.clone(), z.clone()
    lse_ours, nll_ours, _, _, dz_ours = triton_rows(z_ours, tc, None, ce, zs, OPTS,
                                                    torch.float32)
    quack(z_quack)
    d_dz, ours_ref, quack_ref = _errors(z, tc, dz_ours, 1.0 / N, z_quack)
    d_lse = (lse_ours - lse).abs().max().item()
    d_loss = (nll_ours - loss).abs().max().item()
    print(f"  quack vs ours: max |d dlogits| {d_dz:.2e} (softmax - onehot units, ours x N),"
          f" |d lse| {d_lse:.2e}, |d loss| {d_loss:.2e}; against float32 softmax - onehot: "
          f"ours {ours_ref:.2e}, quack {quack_ref:.2e}", flush=True)


if __name__ == "__main__":
    fwd_out = quack_fwd_out()
    run_shapes(lambda name: probe_shape(name, fwd_out))

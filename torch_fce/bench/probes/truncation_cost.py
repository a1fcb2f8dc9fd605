"""What does the sampler's truncation cost against the untruncated log-probs, and where
does the threshold kernel's time go?

Per shape (default E and A; bf16, the benchmark's inputs, temperature 0.7):
`linear_logprobs` with entropy, forward alone and forward + backward, untruncated and
under each truncation below (median of 10), as multiples of the untruncated time.
Then, on one 4096-row logits chunk of the shape, the threshold kernel's time
(ops/linear_logprobs/truncation_kernels.py: top_p / min_p without a top-k) against one
read of the chunk (z.amax), so the ratio counts its sweeps of the row.

    python -m torch_fce.bench.probes.truncation_cost [E A ...]    # needs one CUDA GPU
"""

import sys

import torch
import triton

import torch_fce
from torch_fce.bench.measure import median_time
from torch_fce.bench.shapes import SHAPES, shape_inputs
from torch_fce.ops.linear_logprobs import LogProbOptions
from torch_fce.ops.linear_logprobs.truncation_kernels import triton_threshold_stats

TRUNCATIONS = [dict(), dict(top_k=50, top_p=0.95), dict(top_p=0.95), dict(top_p=0.9),
               dict(min_p=0.05), dict(top_p=0.95, min_p=0.05)]
T = 0.7


def _ms(fn):
    return median_time(fn, "cuda", reps=10, warmup=2) * 1e3


def probe(name):
    shape = SHAPES[name]
    x = shape_inputs(shape)
    h, w, y = x["hidden"], x["weight"], x["target"]
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd(opts):
        with torch.no_grad():
            return torch_fce.linear_logprobs(h, w, y, temperature=T, entropy=True, **opts)

    def step(opts):
        out = torch_fce.linear_logprobs(hg, wg, y, temperature=T, entropy=True, **opts)
        (out.logprob.nan_to_num(0.0, 0.0, 0.0).sum() + out.entropy.sum()).backward()
        hg.grad = wg.grad = None

    base = None
    for opts in TRUNCATIONS:
        f, b = _ms(lambda: fwd(opts)), _ms(lambda: step(opts))
        base = base or (f, b)
        print(f"{name} {opts or 'untruncated'}: forward {f:.2f} ms ({f / base[0]:.2f}x), "
              f"forward+backward {b:.2f} ms ({b / base[1]:.2f}x)", flush=True)

    z = (h[:4096] @ w.T).contiguous()
    t = y[:4096]
    inv_t = torch.full((4096,), 1 / T, device="cuda")
    read = _ms(lambda: z.amax())
    for opts in TRUNCATIONS:
        if "top_k" in opts or not opts:
            continue
        o = LogProbOptions(entropy=True, **opts)
        k = _ms(lambda: triton_threshold_stats(z, t, inv_t, o, torch.float32))
        print(f"{name} chunk 4096 x {shape.V} {opts}: threshold kernel {k:.3f} ms = "
              f"{k / read:.1f} reads of the chunk ({read:.3f} ms)", flush=True)
    del x, h, w, hg, wg, z


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    for name in sys.argv[1:] or "EA":
        probe(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

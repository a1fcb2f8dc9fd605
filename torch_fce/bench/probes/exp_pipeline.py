"""Issue 56's pipeline on the GPU: the exp-GEMM backend (TORCH_FCE_BACKEND=exp, loop/exp_gemms.py)
against its PyTorch twin, float64, today's rows and quack's default pipeline.

Per shape (bench/shapes.py, bf16):
 1. pieces: each CuTe GEMM (exp_gemms_cute) against the torch twin (exp_gemms) on one
    chunk of 256 rows (two tiles), the same inputs: E, sum_exp, k, z_y; dx; dW first + add.
 2. errors: the mean cross entropy's loss, dx and dW on N_ERR rows against float64, for
    both backends (the exp pipeline and today's rows).
 3. time: forward + backward of the mean cross entropy on the shape's N, median of 10,
    the two backends (the exp one also with its row math in PyTorch) and quack's
    default pipeline alternating in one process, with peaks.
 4. --plans: the exp pipeline at its chunk plan (exp_gemms.wave_plan) and at others.
 5. --ws=MiB,...: both backends at several workspaces. 6. --profile: per-kernel times.

    source .peers/setup.sh && python -m torch_fce.bench.probes.exp_pipeline [D E Q1024 A]
"""

import sys
import time
import traceback

import torch

from torch_fce import linear_cross_entropy
from torch_fce.bench.measure import backend, median_time
from torch_fce.bench.shapes import SHAPES
from torch_fce.ops.linear_ce import CEOptions, exp_rows
from torch_fce.ops.loop import exp_gemms

from torch_fce.bench.probes._common import profile_steps

N_ERR = 2048


def rel(a, e):
    a, e = a.double(), e.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


def inputs(N, D, V, seed=0, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(N, D, device=dev, generator=g).bfloat16()
    w = (torch.randn(V, D, device=dev, generator=g) * (2.0 / D ** 0.5)).bfloat16()
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    return x, w, t


def pieces(D, V):
    from torch_fce.ops.loop import exp_gemms_cute as cute
    M, tile_n = 256, exp_gemms.tile_n_for(V)
    x, w, t = inputs(M, D, V, 1)
    t[7] = -100  # an ignored row: no selected column
    here = t >= 0
    col = torch.where(here, t, -1)
    a = exp_gemms.logits(x, w, col, tile_n, x.new_empty(M, V))
    b = cute.logits(x, w, col, tile_n, x.new_empty(M, V))
    torch.cuda.synchronize()
    print(f"  logits: E rel {rel(b.E, a.E):.2e} (ulps differ "
          f"{(b.E != a.E).float().mean().item():.3%}), k differ {(b.k != a.k).sum().item()}, "
          f"sum_exp rel {rel(b.sum_exp, a.sum_exp):.2e}, zy rel "
          f"{rel(b.zy[here], a.zy[here]):.2e}", flush=True)
    opts = CEOptions(reduction="sum")
    sc = (torch.ones(M, device="cuda"), torch.zeros(M, device="cuda"))
    _, g = exp_rows.exp_rows(a, t, None, sc, opts, V, None)
    r = torch.zeros(D, device="cuda")
    o1, o2 = x.new_empty(M, D), x.new_empty(M, D)
    exp_gemms.dx(g, w, r, o1)
    cute.dx(g, w, r, o2, exp_gemms.DxTiles(128))
    o3 = x.new_empty(M, D)
    cute.dx(g, w, r, o3, exp_gemms.DxTiles(128, 3))
    d1, d2 = torch.empty(V, D, device="cuda"), torch.empty(V, D, device="cuda")
    exp_gemms.dw_add(g, x, d1, True)
    cute.dw_add(g, x, d2, True)
    f1 = rel(d2, d1)
    exp_gemms.dw_add(g, x, d1, False)
    cute.dw_add(g, x, d2, False)
    torch.cuda.synchronize()
    print(f"  dx rel {rel(o2, o1):.2e} (split 3: {rel(o3, o1):.2e}); dW first rel {f1:.2e}, after add {rel(d2, d1):.2e}",
          flush=True)


def step(x, w, t, fn=None):
    def run():
        h, W = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = (fn or linear_cross_entropy)(h, W, t)
        loss.backward()
        return loss, h.grad, W.grad
    return run


def with_backend(name, fn):
    def run():
        with backend(name):
            return fn()
    return run


def with_torch_rows(fn):
    """fn on the exp pipeline with its row math in PyTorch (exp_rows.exp_rows, ~25 small
    operations a chunk) instead of the Triton kernel: that kernel's share of the step."""
    from torch_fce.ops.linear_ce import exp_kernels

    def run():
        kernel = exp_kernels.triton_exp_rows
        exp_kernels.triton_exp_rows = exp_rows.exp_rows
        try:
            with backend("exp"):
                return fn()
        finally:
            exp_kernels.triton_exp_rows = kernel
    return run


def errors(D, V):
    x, w, t = inputs(N_ERR, D, V, 2)
    t[::17] = -100
    h, W = x.double().requires_grad_(), w.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(h @ W.T, t, ignore_index=-100)
    loss.backward()
    for name in ("triton", "exp"):
        l, gx, gw = with_backend(name, step(x, w, t))()
        print(f"  {name:6s} loss {abs(l.item() - loss.item()) / loss.item():.2e} "
              f"dx {rel(gx, h.grad):.2e} dW {rel(gw, W.grad):.2e}", flush=True)


def timing(shape):
    from torch_fce.bench.peers import _quack
    x, w, t = inputs(shape.N, shape.D, shape.V, 3)
    fns = {"fce-rows": with_backend("triton", step(x, w, t)),
           "fce-exp": with_backend("exp", step(x, w, t)),
           "fce-exp-torch-rows": with_torch_rows(step(x, w, t))}
    try:
        fns["quack-fused-8192"] = step(x, w, t, _quack(8192, True))
    except Exception as e:  # noqa: BLE001
        print(f"  quack unavailable: {e}")
    for f in fns.values():  # warm up (JIT, autotune)
        f()
    res = {k: [] for k in fns}
    peaks = {}
    for _ in range(3):
        for k, f in fns.items():
            torch.cuda.reset_peak_memory_stats()
            res[k].append(median_time(f, "cuda", reps=10, warmup=1) * 1e3)
            peaks[k] = torch.cuda.max_memory_allocated() / 2**30
    mm = median_time(lambda: x @ w.T, "cuda", reps=10, warmup=2) * 1e3
    for k, v in res.items():
        ms = sorted(v)[1]
        print(f"  {k:18s} {ms:8.2f} ms  ({ms / mm:.2f}x mm)  peak {peaks[k]:.2f} GiB  "
              f"runs {['%.2f' % a for a in v]}", flush=True)
    base = sorted(res["fce-exp"])[1]
    for k, v in res.items():
        print(f"  fce-exp / {k}: {base / sorted(v)[1]:.3f}")


def profile(shape):
    """Per-kernel CUDA time of one forward + backward of each backend and quack's."""
    from torch_fce.bench.peers import _quack
    x, w, t = inputs(shape.N, shape.D, shape.V, 3)
    profile_steps({"fce-exp": with_backend("exp", step(x, w, t)),
                   "fce-rows": with_backend("triton", step(x, w, t)),
                   "quack-fused-8192": step(x, w, t, _quack(8192, True))},
                  cpu=True, row_limit=14, width=70)


def plans(shape):
    """fce-exp forward + backward at its plan (exp_gemms.wave_plan) and at others: the
    workspace's chunk at quack's dx tile unsplit (the plan before wave_plan), the best
    unsplit plan (wave_plan before splits), and the model's next two; alternating, with
    each one's peak memory, and the hidden gradient's difference from the unsplit's."""
    from torch_fce.ops.loop import exp_gemms_cute as cute
    from torch_fce.ops.loop.workspace import chunk_rows
    N, D, V = shape.N, shape.D, shape.V
    x, w, t = inputs(N, D, V, 3)
    cap = chunk_rows(N, V, D, torch.bfloat16, "cuda", per_logit=exp_gemms.BYTES_PER_LOGIT)
    sms = cute._sms(torch.cuda.current_device())
    best = exp_gemms.wave_plan(N, D, V, cap, sms)
    cost = lambda o: exp_gemms._chunk_cost(o[0], N, D, V, o[1], sms)  # noqa: E731
    ranked = sorted({(m, exp_gemms.DxTiles(tn, k)) for m in range(256, cap + 1, 128)
                     for tn in (128, 192, 256) for k in exp_gemms._DX_SPLITS}, key=cost)
    unsplit = next(o for o in ranked if o[1].split == 1)
    old = (-(-cap // 128) * 128, exp_gemms.DxTiles(192 if D % 192 == 0 else 256))
    named = {best: "plan", old: "old", unsplit: "unsplit"}
    variants = list(named) + [o for o in ranked if o not in named][:2]
    real = cute.plan
    res = {o: [] for o in variants}
    peaks, grads = {}, {}
    try:
        for _ in range(2):
            for o in variants:
                cute.plan = lambda *a, o=o: o
                f = with_backend("exp", step(x, w, t))
                grads[o] = f()[1]
                torch.cuda.reset_peak_memory_stats()
                res[o].append(median_time(f, "cuda", reps=10, warmup=1) * 1e3)
                peaks[o] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        cute.plan = real
    for o in variants:
        print(f"  {named.get(o, 'alt'):7s} rows {o[0]:5d} dx tile_N {o[1].tile_n} split "
              f"{o[1].split}: {min(res[o]):7.2f} ms (model {cost(o) * 1e3:.2f} ms) peak "
              f"{peaks[o]:.2f} GiB, dx vs unsplit rel {rel(grads[o], grads[unsplit]):.1e}",
              flush=True)


def workspaces(shape, mibs):
    """fce-exp and fce-rows forward + backward at several workspaces, alternating."""
    from torch_fce.ops.loop.workspace import set_workspace
    x, w, t = inputs(shape.N, shape.D, shape.V, 3)
    out = {}
    for mib in mibs:
        for name in ("exp", "triton"):
            prev = set_workspace(mib << 20)
            try:
                f = with_backend(name, step(x, w, t))
                f()
                torch.cuda.reset_peak_memory_stats()
                ms = median_time(f, "cuda", reps=10, warmup=1) * 1e3
                out[(mib, name)] = (ms, torch.cuda.max_memory_allocated() / 2**30)
            finally:
                set_workspace(prev)
    for (mib, name), (ms, peak) in out.items():
        print(f"  {mib:5d} MiB {name:6s} {ms:7.2f} ms peak {peak:.2f} GiB", flush=True)


def section(title, fn, *a):
    t0 = time.perf_counter()
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001 (a probe: report and go on)
        print(f"  [{title}] FAILED: {type(e).__name__}: {e}")
        traceback.print_exc(limit=-6, file=sys.stdout)
    print(f"  [{title}] {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv):
    names = [a for a in argv if not a.startswith("-")] or ["D", "E", "Q1024", "A"]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for n in names:
        s = SHAPES[n]
        print(f"{n}: N {s.N} D {s.D} V {s.V} (tile_n {exp_gemms.tile_n_for(s.V)})", flush=True)
        if "--no-pieces" not in argv:
            section("pieces", pieces, s.D, s.V)
        if "--no-errors" not in argv:
            section("errors", errors, s.D, s.V)
        if "--no-time" not in argv:
            section("time", timing, s)
        if "--plans" in argv:
            section("plans", plans, s)
        ws = [a for a in argv if a.startswith("--ws=")]
        if ws:
            section("workspaces", workspaces, s, [int(v) for v in ws[0][5:].split(",")])
        if "--profile" in argv:
            section("profile", profile, s)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

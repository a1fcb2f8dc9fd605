"""Issue 56's probe: can CuTe DSL GEMMs (quack-kernels 0.6.5) drop the row sweep of the
(chunk, V) logits tile on Hopper? Before building a backend on them.

On one chunk x_c (the backend's chunk_rows of N) and the head W (V, D), bf16, it times
(median of 20 after warm-up; quack JIT-compiles each variant on its first call, seconds
to tens of seconds, outside the timing) and checks against a float64 torch reference:

 1. cuBLAS: logits x_c @ W.T (bf16 out, fp32 out), dx G @ W, dW G.T @ x_c (bf16 and
    fp32 out) on a materialised bf16 G = g * (softmax - onehot).
 2. The logits GEMM with a statistics epilogue (quack.epilogue.frontend.gemm_epilogue):
    (a) quack's scaled_exp_target_epi: stores E = bf16 2^(z log2e - k) with a per-(row,
        n-tile) integer k, and writes sum_exp and k per (row, n-tile) and z[i, y_i];
    (b) library.lse_target_epi: stores z itself (fp32 D, and bf16 D), OnlineLSEReduce
        partials per (row, n-tile) and z[i, y_i].
    The partials merge in torch into lse per row; lse and loss against float64.
 3. The gradient GEMMs with the A-operand transform (quack.operand_transform.a_transform):
    dx(a): quack's own: glue (its Triton lce_glue: loss, E[i, y_i] fixed in place to
        (p_y - 1) / s, the pow2 strip u = 2^(k - k_r) per (row, 64 columns), the per-row
        fp32 v = g 2^k_r e^-lse and xs = bf16(bf16(v) x)), then E (.) u through the
        colvec_ktile transform, v in the epilogue (exact fp32).
    dW(a): quack's own: E^T (.) u through kvec_m64, B = xs: x's rows rounded to bf16 a
        second time (v lies along K in dW, so it cannot move to the epilogue).
    dW(a'): the same strip with v folded in, bf16(u v) per (64 classes, row), B = x_c
        unrounded: the second rounding moves from x to the (per-row) factor.
    dx(b): stored bf16 z read through a transform exp(z - c_i) (c_i = round(lse_i),
        exact in bf16), v' = g e^(c - lse) in the epilogue and the one-hot term as the
        C operand -g W[y_i]. fp32 z cannot be the transform's A: value transforms take a
        16-bit A only (quack/operand_transform/transform.py, TransformAValue).
    Each against the cuBLAS GEMM of the same product, and dx/dW errors against float64.

    python -m torch_fce.bench.probes.cute_fused_gemms [D E A Q1024]   # one Hopper GPU,
        # quack + cutlass-dsl importable (source .peers/setup.sh)
    python -m torch_fce.bench.probes.cute_fused_gemms --compile-only [D]   # no GPU: traces
        # and compiles every quack kernel for sm_90a (CPU tensors as metadata), no launches
"""

import math
import os
import sys
import time
import traceback

import torch

COMPILE_ONLY = "--compile-only" in sys.argv
if COMPILE_ONLY:  # CPU cross-compile: quack's dispatch arch and cutlass-dsl's target
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from torch_fce.bench.measure import median_time  # noqa: E402
from torch_fce.bench.shapes import SHAPES  # noqa: E402
from torch_fce.ops.loop.workspace import chunk_rows  # noqa: E402

REPS, WARMUP = 20, 3
LN2, LOG2E = math.log(2.0), 1.0 / math.log(2.0)
DEV = "cpu" if COMPILE_ONLY else "cuda"


def ms(fn):
    return median_time(fn, "cuda", reps=REPS, warmup=WARMUP) * 1e3


def errs(actual, expected):
    """max abs error, relative L2 error (float64)."""
    a, e = actual.double(), expected.double()
    den = e.norm()
    return (a - e).abs().max().item(), ((a - e).norm() / den).item() if den > 0 else float("nan")


def fmt_err(label, actual, expected):
    mx, rel = errs(actual, expected)
    return f"{label} max {mx:.2e} rel {rel:.2e}"


def section(title, fn):
    """Runs one piece; an exception prints and the next piece runs."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (a probe: report and go on)
        print(f"  [{title}] FAILED: {type(e).__name__}: {e}")
        traceback.print_exc(limit=-4, file=sys.stdout)
    print(f"  [{title}] {time.perf_counter() - t0:.1f} s wall (JIT included)", flush=True)


def _quack():
    """quack's pieces, imported here only (an optional peer)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.library import identity_epi, lse_target_epi
    from quack.epilogue.ops import ColVecLoad
    from quack.epilogue.scaled_exp import scaled_exp_target_epi
    from quack.linear_cross_entropy import (_lce_dw_scale, _lce_dx_scale, _pick_tile_n1,
                                            lce_glue)
    from quack.operand_transform import a_transform
    from quack.operand_transform.host import transform_a_operand

    if COMPILE_ONLY:  # the one driver query on the compile path (SM count)
        import quack.gemm_runtime.host as host
        host.get_max_active_clusters = lambda cluster_size: 132 // cluster_size

    # dx's per-row fp32 factor in the epilogue. The colvec is pinned: quack's own
    # _lce_vscale_epi infers it from the shape and fails when the chunk equals D.
    @gemm_epilogue(ops={"v": ColVecLoad("v")})
    def dx_v_epi(acc, v):
        return {"D": acc * v}

    # dx(b): factor and one-hot term in the epilogue (C = -g W[y], bf16).
    @gemm_epilogue(ops={"v": ColVecLoad("v")})
    def dx_v_c_epi(acc, c, v):
        return {"D": acc * v + c}

    # dx(b)'s operand: exp(z - c) from stored bf16 z, c per (row, k-tile) (here the
    # same for every k-tile of a row: round(lse)), in fp32, back to bf16 by the frame.
    @a_transform(vec_size=8, args={"c": "colvec_ktile"})
    def exp_shift(x, c):
        return cute.math.exp(x.to(Float32) - c.to(Float32), fastmath=True)

    return dict(cutlass=cutlass, identity_epi=identity_epi, lse_target_epi=lse_target_epi,
                scaled_exp_target_epi=scaled_exp_target_epi, dx_scale=_lce_dx_scale,
                dw_scale=_lce_dw_scale, pick_tile_n1=_pick_tile_n1, lce_glue=lce_glue,
                bundle=transform_a_operand, dx_v_epi=dx_v_epi, dx_v_c_epi=dx_v_c_epi,
                exp_shift=exp_shift)


def gemm(mod, *args, **kwargs):
    """mod.gemm, compiled and not launched under --compile-only."""
    return mod.gemm(*args, **kwargs, _launch=not COMPILE_ONLY)


def probe_shape(name, q):
    N, D, V = SHAPES[name].N, SHAPES[name].D, SHAPES[name].V
    M = 1024 if COMPILE_ONLY else chunk_rows(N, V, D, torch.bfloat16, "cuda")
    tile_n1 = q["pick_tile_n1"](V)  # the logits GEMM's tile_N, quack's rule
    T, R = V // tile_n1, V // 64  # n-tiles; 64-column groups (the strip's rows)
    tile_n2 = 192 if D % 192 == 0 else 256  # quack's dx/dW tile_N over D
    print(f"{name} (chunk {M} x V {V}, D {D}; logits tile_N {tile_n1}, "
          f"grad tile_N {tile_n2})", flush=True)
    assert V % tile_n1 == 0 and V % 128 == 0 and M % 128 == 0
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(M, D, device=DEV, generator=g) / D ** 0.5).bfloat16()
    w = (torch.randn(V, D, device=DEV, generator=g) * 2).bfloat16()
    t = torch.randint(0, V, (M,), device=DEV, generator=g)
    grad = 1.0  # g_i: the loss's per-row weight (sum reduction)
    f32, bf16 = dict(device=DEV, dtype=torch.float32), dict(device=DEV, dtype=torch.bfloat16)

    ref, base = {}, {}
    if not COMPILE_ONLY:
        z64 = x.double() @ w.double().T
        ref["lse"] = torch.logsumexp(z64, 1)
        ref["loss"] = ref["lse"] - z64.gather(1, t[:, None])[:, 0]
        G64 = torch.softmax(z64, 1)
        del z64
        G64[torch.arange(M, device=DEV), t] -= 1.0
        G64 *= grad
        ref["dx"] = G64 @ w.double()
        ref["dW"] = G64.T @ x.double()
        G = G64.bfloat16()
        del G64
        torch.cuda.empty_cache()

        def cublas():
            zb = torch.empty(M, V, **bf16)
            base["logits"] = ms(lambda: torch.mm(x, w.T, out=zb))
            del zb  # out_dtype takes no out= (the allocator hands the same block back)
            base["logits32"] = ms(lambda: torch.mm(x, w.T, out_dtype=torch.float32))
            dx, dWb = torch.empty(M, D, **bf16), torch.empty(V, D, **bf16)
            base["dx"] = ms(lambda: torch.mm(G, w, out=dx))
            base["dW"] = ms(lambda: torch.mm(G.T, x, out=dWb))
            base["dW32"] = ms(lambda: torch.mm(G.T, x, out_dtype=torch.float32))
            dWf = torch.mm(G.T, x, out_dtype=torch.float32)
            print(f"  cuBLAS: logits bf16 {base['logits']:.3f} ms, fp32 {base['logits32']:.3f}"
                  f" ms; dx {base['dx']:.3f} ms ({fmt_err('err', dx, ref['dx'])}); dW bf16 "
                  f"{base['dW']:.3f} ms, fp32 {base['dW32']:.3f} ms "
                  f"({fmt_err('err', dWf, ref['dW'])})")
        section("cuBLAS", cublas)
        del G

    def ratio(ms_, key):
        return f"{ms_:.3f} ms = {ms_ / base[key]:.3f}x cuBLAS" if key in base else f"{ms_:.3f} ms"

    # ---- 2(a) quack's scaled-exp logits GEMM, then its glue ----------------------------
    E = torch.empty(M, V, **bf16)
    sum_exp, kk = torch.empty(M, T, **f32), torch.empty(M, T, **f32)
    zy, v_row = torch.empty(M, **f32), torch.empty(M, **f32)
    strip = torch.empty(R, M, **bf16)  # (V / 64, M): one strip serves dx and dW
    xs = torch.empty(M, D, **bf16)
    loss = torch.empty(M, **f32)
    st = {}

    def logits_a():
        def run():
            return gemm(q["scaled_exp_target_epi"], x, w, E, epi_args=dict(
                max_log2=tile_n1, sum_exp=sum_exp, max_log2_out=kk, target=t,
                target_logit=zy), tile_M=128, tile_N=tile_n1, cluster_M=2, cluster_N=1,
                pingpong=tile_n1 <= 208)
        run()
        if COMPILE_ONLY:
            print("  2(a) scaled_exp_target_epi: compiled")
            return
        k_r = kk.max(1).values
        lse = k_r * LN2 + torch.log((sum_exp * torch.exp2(kk - k_r[:, None])).sum(1))
        t_ms = ms(run)
        # quack's glue: loss, E[i, y] fixed, strip, v, xs (grad_scale None: g = 1)
        glue = lambda: q["lce_glue"](kk, sum_exp, x, t, zy, E, loss, strip, v_row, xs,
                                     tile_n1)
        glue_ms = ms(glue)  # idempotent: E[i, y] is rewritten from zy, not from E
        st["a"] = True
        print(f"  2(a) logits + scaled-exp stats: {ratio(t_ms, 'logits')} bf16 logits; "
              f"glue {glue_ms:.3f} ms; {fmt_err('lse', lse, ref['lse'])}; "
              f"{fmt_err('loss', loss, ref['loss'])} "
              f"(torch merge {fmt_err('loss', lse - zy, ref['loss'])})")
    section("2(a) scaled_exp", logits_a)

    # ---- 2(b) the logits themselves (fp32, bf16) with online-LSE partials --------------
    zf, zb = torch.empty(M, V, **f32), torch.empty(M, V, **bf16)
    tile_nb = 256 if V % 256 == 0 else 128  # OnlineLSEReduce masks a ragged tile anyway
    lse_parts = torch.empty(M, -(-V // tile_nb), **f32)
    zy_b = torch.empty(M, **f32)

    def logits_b():
        for label, z, key in (("fp32 z", zf, "logits32"), ("bf16 z", zb, "logits")):
            def run(z=z):
                return gemm(q["lse_target_epi"], x, w, z, epi_args=dict(
                    lse=lse_parts, target=t, target_logit=zy_b), tile_M=128,
                    tile_N=tile_nb, cluster_M=2, cluster_N=1)
            run()
            if COMPILE_ONLY:
                print(f"  2(b) lse_target_epi, {label}: compiled")
                continue
            lse = torch.logsumexp(lse_parts, 1)
            t_ms = ms(run)
            st["lse_b"] = lse.clone()
            print(f"  2(b) logits ({label}) + online-LSE stats: {ratio(t_ms, key)} "
                  f"{'fp32' if key == 'logits32' else 'bf16'} logits; "
                  f"{fmt_err('lse', lse, ref['lse'])}; "
                  f"{fmt_err('loss', lse - zy_b, ref['loss'])}")
    section("2(b) lse_target_epi", logits_b)

    # ---- 3 gradient GEMMs with the A-operand transform ---------------------------------
    dx = torch.empty(M, D, **bf16)
    dW = torch.empty(V, D, **f32)

    def dx_a():
        bundle = q["bundle"](q["dx_scale"], E, {"u": strip}, 128, 64)

        def run():
            return gemm(q["dx_v_epi"], bundle, w.mT, dx, epi_args=dict(v=v_row.unsqueeze(0)),
                        transform_a=q["dx_scale"], tile_M=128, tile_N=tile_n2, tile_K=64,
                        cluster_M=2, cluster_N=1)
        run()
        if COMPILE_ONLY:
            print("  3 dx(a) colvec_ktile transform: compiled")
            return
        t_ms = ms(run)
        print(f"  3 dx(a) E (.) u, v in the epilogue: {ratio(t_ms, 'dx')}; "
              f"{fmt_err('dx', dx, ref['dx'])}")
    section("3 dx(a)", dx_a)

    def dw_a():
        bundle = q["bundle"](q["dw_scale"], E.t(), {"u": strip}, 128, 64)

        def run(b_op=xs, bundle=bundle):
            return gemm(q["identity_epi"], bundle, b_op.mT, dW, epi_args={},
                        transform_a=q["dw_scale"], tile_M=128, tile_N=tile_n2, tile_K=64,
                        cluster_M=1, cluster_N=2)
        run()
        if COMPILE_ONLY:
            print("  3 dW(a) kvec_m64 transform: compiled")
            return
        t_ms = ms(run)
        print(f"  3 dW(a) quack's: E^T (.) u, B = bf16(bf16(v) x): {ratio(t_ms, 'dW32')} "
              f"fp32 dW; {fmt_err('dW', dW, ref['dW'])}")
        # (a'): v folded into the strip (rounded once, per (64 classes, row)), B = x
        k_r = kk.max(1).values
        uv = (torch.exp2(kk - k_r[:, None]) * v_row[:, None]).repeat_interleave(
            tile_n1 // 64, 1)  # (M, V / 64)
        strip_uv = uv.T.contiguous().bfloat16()
        bundle2 = q["bundle"](q["dw_scale"], E.t(), {"u": strip_uv}, 128, 64)
        run(x, bundle2)
        t2 = ms(lambda: run(x, bundle2))
        print(f"  3 dW(a') E^T (.) bf16(u v), B = x: {ratio(t2, 'dW32')} fp32 dW; "
              f"{fmt_err('dW', dW, ref['dW'])}")
    section("3 dW(a)", dw_a)

    def dx_b():
        # stored bf16 z (2(b)'s D, or a cuBLAS one when that piece failed)
        lse = st.get("lse_b")
        if not COMPILE_ONLY and lse is None:
            torch.mm(x, w.T, out=zb)
            lse = torch.logsumexp(zb.float(), 1)
        c = torch.zeros(M, **f32) if COMPILE_ONLY else torch.round(lse)
        strip_c = c.bfloat16()[None, :].expand(R, M).contiguous()  # (V / 64, M)
        v_b = (grad * torch.exp(c - (c if COMPILE_ONLY else lse))).float()
        onehot = -grad * w[t]  # (M, D) bf16: the -g W[y_i] term
        bundle = q["bundle"](q["exp_shift"], zb, {"c": strip_c}, 128, 64)

        def run():
            return gemm(q["dx_v_c_epi"], bundle, w.mT, dx, onehot,
                        epi_args=dict(v=v_b.unsqueeze(0)), transform_a=q["exp_shift"],
                        tile_M=128, tile_N=tile_n2, tile_K=64, cluster_M=2, cluster_N=1)
        run()
        if COMPILE_ONLY:
            print("  3 dx(b) exp transform on bf16 z: compiled")
            return
        t_ms = ms(run)
        print(f"  3 dx(b) exp(z - c) from bf16 z, C = -g W[y]: {ratio(t_ms, 'dx')}; "
              f"{fmt_err('dx', dx, ref['dx'])}")
    section("3 dx(b)", dx_b)


def main():
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["D", "E", "A", "Q1024"]
    q = _quack()
    import quack
    if COMPILE_ONLY:
        print(f"compile only (QUACK_ARCH {os.environ['QUACK_ARCH']}, CUTE_DSL_ARCH "
              f"{os.environ['CUTE_DSL_ARCH']}), torch {torch.__version__}, quack "
              f"{getattr(quack, '__version__', '?')}")
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, quack "
              f"{getattr(quack, '__version__', '?')}")
    for name in names:
        probe_shape(name, q)
        if not COMPILE_ONLY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

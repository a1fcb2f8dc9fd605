"""Triton rows for the sampler's truncation (truncation.py's rules; TRITON_TRUNCATION_ROWS
below): the candidates' z under a top-k, the kept set's gradient on the log-probs' sweep
(kernels.py), the kept set under top_p and min_p without a top-k, found by sweeps of the row
instead of a sort of it (the threshold kernel), and a vocabulary shard's processed z and
tally for the search of values (truncation.sharded_kept_stats).

The threshold kernel: one program per token row, z = softcap(l) / T as the log-probs'
gradient sweep forms it (so its kept-set test sees these bits), NaN ranked as -inf. A
sweep's step is LANES lanes of U consecutive classes: a lane loads a vector and keeps its
sums in its thread, the lanes' sums merged once after the sweep (no block-wide scan in a
step).
  sweep 1  the max m, its first class, the sum s of exp(z - m), the smallest finite z,
           the count, mean and deviation of the finite z; z at the target.
  min_p    one sweep: the mass S0 of the classes at or above m + log(min_p) (without
           min_p every finite class: S0 = s), and its sum of exp(z - m) (z - m).
           Without top_p, K is those classes (ties all kept); with neither (a top_k >= V
           alone) every finite class, its sums from the same sweep.
  top_p    K is the shortest prefix (z desc, class asc) of those classes whose mass
           reaches T = top_p S0: a class is kept while the mass before it is < T. With
           f(x) the mass of the classes above x, K's last value v is the smallest value
           with f(v) < T. A bracket (lo, hi] with f(lo) >= T > f(hi) holds it. Each
           sweep evaluates f at three points and keeps the quarter holding v, its ends
           drawn in to the bracket's values: the first sweep's points at v as a normal
           law of the z would place it (_guess: a poor guess costs sweeps, never another
           K), then value quarters, then, should those stall, quarters of the values'
           int32 images (at most 24 + 32 sweeps). Should v lie beyond the first points,
           the second sweep's are thirds of the spread beyond them. A sweep of the row
           writes the sort keys of a window's classes to the row's scratch (CAP), each
           lane to its own region of CAP / LANES slots (a region too small: the window
           unwritten): the first points' outer pair (the guess puts about 0.4 CAP
           classes there), else the whole bracket where it holds at most CAP / 4
           classes, else the outer points. Once the bracket lies in a written window,
           the sweeps read the scratch instead. At most C classes left, a sweep writes
           their keys to C slots (each lane's at a per-row atomic counter's slots, in
           any order) and a sort of them walks their masses down from f(hi) to K's
           last class. A bracket of one value holding
           more than C classes holds ties: the first of them by class are kept while the
           mass before each is < T, and one sweep finds the last one's class.
Per row (m, s, s_K, sum over K of exp(z - m)(z - m), v, c, argmax, z_y): K is the classes
with z > v, or z == v and class <= c.
"""

import math

import torch
import triton
import triton.language as tl

from ..linear_topk_logprobs.kernels import _EMPTY, _ranked, _sort_key, triton_topk_rows
from ..rowmath.kernels import (_NEG_BIG, _below, _block_v, _from_image, _image, _load_z,
                               _phi, _phi_inv, _unkey, dz_buffer)
from .kernels import _launch
from .truncation import TopKRecord, TruncationRows, eighths, kept_outputs, narrowed, \
    search_rounds
from .truncation import _from_image as value_of_image, _image as image_of

_C = 256  # the threshold kernel's sort of the bracket's classes
_CAP = 8192  # its scratch's classes a row at most (V / 8 at most: a byte a logit)
_BLOCK, _STAGES = 1024, 1  # its sweeps' classes a step, their loads in flight
_BRACKET_STAGES = 3  # the bracket's sweeps of the row's (H100: 0.9x the kernel at 1)
_U = 8  # a step's lanes' consecutive classes (a lane's sums folded in its thread)
_WARPS = 4
_VALUE_STEPS = 24  # its sweeps at quarters of the values, then of their int32 images


@triton.jit
def _z(row_ptr, offs, V, inv_t, softcap, HAS_SOFTCAP: tl.constexpr):
    """z of classes offs (-inf past V), and its selection value (NaN as -inf)."""
    z = _load_z(row_ptr + offs, offs < V, softcap, HAS_SOFTCAP) * inv_t
    return z, _ranked(z)


@triton.jit
def _entry(row_ptr, scr, offs, n_s, V, inv_t, softcap, HAS_SOFTCAP: tl.constexpr):
    """(selection value, class, present) of entries offs of the search's source: the
    row, or (n_s > 0) its scratch of n_s sort keys."""
    if n_s > 0:  # (n_s: the scratch's slots)
        key = tl.load(scr + offs, mask=offs < n_s, other=_EMPTY)
        ok = key != _EMPTY
        r = _unkey((key >> 32).to(tl.int32))
        cls = 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)
    else:
        ok = offs < V
        _, r = _z(row_ptr, offs, V, inv_t, softcap, HAS_SOFTCAP)
        cls = offs
    return r, cls, ok


@triton.jit
def _slots(hit, before):
    """Class-order slots of a step's hits (lanes of consecutive classes) after `before`."""
    h = hit.to(tl.int32)
    n = tl.sum(h, axis=1)
    return before + (tl.cumsum(n, axis=0) - n)[:, None] + tl.cumsum(h, axis=1) - 1


@triton.jit
def _tally(r, e, inside, q1, q2, q3, m, f1, f2, f3, g1, g2, g3, n1, n2, n3, b_lo, b_hi):
    """A block's share of a sweep's sums: masses e above each point (f), their
    exp(z - m) (z - m) (g), the bracket's (inside) classes above each (n) and its
    smallest and largest values."""
    ez = tl.where(e > 0.0, e * (r - m), 0.0)
    f1 += tl.sum(e, axis=1)
    g1 += tl.sum(ez, axis=1)
    up = r > q2
    f2 += tl.sum(tl.where(up, e, 0.0), axis=1)
    g2 += tl.sum(tl.where(up, ez, 0.0), axis=1)
    n2 += tl.sum((up & inside).to(tl.int32), axis=1)
    up = r > q3
    f3 += tl.sum(tl.where(up, e, 0.0), axis=1)
    g3 += tl.sum(tl.where(up, ez, 0.0), axis=1)
    n3 += tl.sum((up & inside).to(tl.int32), axis=1)
    n1 += tl.sum(((r > q1) & inside).to(tl.int32), axis=1)
    b_lo = tl.minimum(b_lo, tl.min(tl.where(inside, r, float("inf")), axis=1))
    b_hi = tl.maximum(b_hi, tl.max(tl.where(inside, r, float("-inf")), axis=1))
    return f1, f2, f3, g1, g2, g3, n1, n2, n3, b_lo, b_hi


@triton.jit
def _guess(mean, sd, m, cut, n, top_p, CAP: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """The first sweep's middle point and its distance to the others: where top_p's
    mass ends if the n classes' z were normal (mean, sd) up to the max m (the mass's
    law then normal, mean + sd^2), from min_p's cut; the distance such that the
    classes between the outer points are about CAP * 0.4 under that law (a lane's
    share of them 0.4 of its region of the scratch: sampling noise does not overfill it)."""
    tilt = mean + sd * sd
    at_m = _phi((m - tilt) / sd)
    at_cut = 0.0 * at_m
    if HAS_MIN_P:
        at_cut = _phi((cut - tilt) / sd)
    guess = tilt + sd * _phi_inv((1.0 - top_p) * at_m + top_p * at_cut)
    t = (guess - mean) / sd
    per_z = n * tl.exp(-0.5 * t * t) * 0.3989422804014327 / sd  # classes a unit of z
    return guess, 0.2 * CAP / per_z


@triton.jit
def _threshold_kernel(
    # pointers
    logits_ptr, target_ptr, inv_t_ptr, buf_ptr, scr_ptr, out_ptr, cnt_ptr,
    # sizes and options
    V, ignore_index, top_p, log_min_p, softcap,
    # strides
    stride_ln,
    # meta-parameters
    HAS_SOFTCAP: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    LANES: tl.constexpr, C: tl.constexpr, CAP: tl.constexpr, U: tl.constexpr,
    VALUE_STEPS: tl.constexpr, STAGES: tl.constexpr, BRACKET_STAGES: tl.constexpr,
):
    """Logits rows (n, V) -> out (n, 8) float32 (module docstring); buf (n, C) and scr
    (n, CAP) int64 the rows' scratch."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    buf = buf_ptr + row * C
    scr = scr_ptr + row * CAP
    out = out_ptr + row * 8
    inv_t = tl.load(inv_t_ptr + row)
    # a step: LANES lanes of U consecutive classes (a lane's load a vector, its sums
    # in the thread)
    cols = tl.arange(0, LANES)[:, None] * U + tl.arange(0, U)[None, :]
    STEP: tl.constexpr = LANES * U
    R: tl.constexpr = CAP // LANES  # a lane's region of the scratch
    region = tl.arange(0, LANES) * R
    cnt = cnt_ptr + row

    # sweep 1: online per lane, merged after; the finite classes' moments of z about z0
    # (its first class's, 0 if not finite: no cancellation at large magnitudes)
    z0 = _load_z(row_ptr, V > 0, softcap, HAS_SOFTCAP) * inv_t
    z0 = tl.where((z0 > _NEG_BIG) & (z0 < -_NEG_BIG), z0, 0.0)
    m_l = tl.full([LANES], _NEG_BIG, tl.float32)  # finite: m - m_new stays a number
    s_l = tl.zeros([LANES], tl.float32)
    u1 = tl.zeros([LANES], tl.float32)
    u2 = tl.zeros([LANES], tl.float32)
    best = tl.full([LANES], float("-inf"), tl.float32)
    best_i = tl.zeros([LANES], tl.int32)
    low = tl.full([LANES], float("inf"), tl.float32)
    finite = tl.zeros([LANES], tl.int32)
    for v0 in tl.range(0, V, STEP, num_stages=STAGES):
        offs = v0 + cols
        z, r = _z(row_ptr, offs, V, inv_t, softcap, HAS_SOFTCAP)
        m_new = tl.maximum(m_l, tl.max(r, axis=1))
        s_l = s_l * tl.exp(m_l - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_l = m_new  # (NaN z: a NaN sum)
        if HAS_TOP_P:
            u = tl.where(r > float("-inf"), r - z0, 0.0)
            u1 += tl.sum(u, axis=1)
            u2 += tl.sum(u * u, axis=1)
        top_l = tl.max(r, axis=1)
        new = top_l > best  # a lane's first maximum
        best_i = tl.where(new, tl.min(tl.where(r == top_l[:, None], offs, V), axis=1), best_i)
        best = tl.where(new, top_l, best)
        low = tl.minimum(low, tl.min(tl.where(r > float("-inf"), r, float("inf")), axis=1))
        finite += tl.sum((r > float("-inf")).to(tl.int32), axis=1)
    m = tl.max(m_l, axis=0)
    s = tl.sum(s_l * tl.exp(m_l - m), axis=0)
    top = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == top, best_i, V), axis=0)
    argmax = tl.where(top > float("-inf"), argmax, 0)  # a row of -inf: its first class
    n_in = tl.sum(finite, axis=0)
    n_all = n_in
    mean = tl.sum(u1, axis=0) / n_in
    sd = tl.sqrt(tl.maximum(tl.sum(u2, axis=0) / n_in - mean * mean, 0.0))
    mean += z0

    # the classes min_p keeps (every finite one without it): z in (lo, m], their mass S0
    lo = _below(tl.minimum(tl.min(low, axis=0), m))
    v = lo
    S0 = s
    G0 = 0.0
    if HAS_MIN_P:
        v = m + log_min_p  # K without top_p: z >= v, ties all kept (c = V)
        lo = _below(v)
    if HAS_MIN_P or not HAS_TOP_P:  # (neither: a top_k >= V alone, K every class)
        f = tl.zeros([LANES], tl.float32)
        g = tl.zeros([LANES], tl.float32)
        n = tl.zeros([LANES], tl.int32)
        for v0 in tl.range(0, V, STEP, num_stages=STAGES):
            _, r = _z(row_ptr, v0 + cols, V, inv_t, softcap, HAS_SOFTCAP)
            e = tl.where(r > lo, tl.exp(r - m), 0.0)
            f += tl.sum(e, axis=1)
            g += tl.sum(tl.where(e > 0.0, e * (r - m), 0.0), axis=1)
            n += tl.sum((r > lo).to(tl.int32), axis=1)
        S0 = tl.sum(f, axis=0)
        G0 = tl.sum(g, axis=0)
        n_in = tl.sum(n, axis=0)
    c = V * 1.0
    s_k = S0
    g_k = G0
    if HAS_TOP_P:
        target_mass = top_p * S0
        hi = m
        f_hi = 0.0 * S0  # f(m), g(m): no class above the max
        g_hi = f_hi
        guess, spread = _guess(mean, sd, m, v, n_all, top_p, CAP, HAS_MIN_P)
        # a row without mass (all -inf) or with a NaN: K its first class, sums as they are
        v = tl.full([], float("-inf"), tl.float32)
        c = argmax.to(tl.float32)
        s_k = f_hi
        g_k = f_hi
        go = (target_mass > 0.0) & (s == s) & (n_in > 0)
        ties = n_in < 0  # int1 tensors: loop-carried values
        step = n_in * 0
        miss = n_in * 0  # the first sweep's v below its points (-1), above them (1)
        n_s = n_in * 0  # 1: the scratch holds the bracket's classes (0: read the row)
        # at most VALUE_STEPS + 32 sweeps (the images' range halves, at least); the
        # bound guards against a hang should a sweep count otherwise than another
        while go & (n_in > C) & (step < VALUE_STEPS + 40):
            k_lo = _image(lo).to(tl.int64)
            k_hi = _image(hi).to(tl.int64)
            if k_hi - k_lo <= 1:  # (lo, hi] is one value: ties at hi
                ties = n_in >= 0
                go = n_in < 0
            else:
                # three points cut the bracket in four: the guess's (should v lie
                # beyond them, the next sweep's the spread's thirds beyond), else value
                # quarters, else the images'; the window (w_lo, w_hi] whose keys a
                # sweep of the row writes: between the guess's outer points, else the
                # whole bracket where a quarter of the scratch holds it
                q1 = tl.maximum(guess - spread, (lo + guess) * 0.5)
                q2 = guess
                q3 = tl.minimum(guess + spread, (guess + hi) * 0.5)
                w_lo = q1
                w_hi = q3
                third = spread * 0.6666667
                if miss < 0:  # (lo, hi]: below the first points
                    q1 = hi - 3.0 * third
                    q2 = hi - 2.0 * third
                    q3 = hi - third
                    w_lo = q1
                    w_hi = hi
                if miss > 0:
                    q1 = lo + third
                    q2 = lo + 2.0 * third
                    q3 = lo + 3.0 * third
                    w_lo = lo
                    w_hi = q3
                near = (lo < q1) & (q1 < q2) & (q2 < q3) & (q3 < hi) & (
                    (step == 0) | ((step == 1) & (miss != 0)))
                apart = near
                if apart == 0:
                    w = hi - lo
                    q1 = lo + w * 0.25
                    q2 = lo + w * 0.5
                    q3 = lo + w * 0.75
                    apart = (lo < q1) & (q1 < q2) & (q2 < q3) & (q3 < hi)
                if (step >= VALUE_STEPS) | (apart == 0):
                    d = k_hi - k_lo  # >= 2: q2 inside, q1 and q3 may meet lo or hi
                    q1 = _from_image((k_lo + d // 4).to(tl.int32))
                    q2 = _from_image((k_lo + d // 2).to(tl.int32))
                    q3 = _from_image((k_lo + d - d // 4).to(tl.int32))
                whole = n_in <= CAP // 4
                w_lo = tl.where(near, w_lo, tl.where(whole, lo, q1))
                w_hi = tl.where(near, w_hi, tl.where(whole, hi, q3))
                f1 = tl.zeros([LANES], tl.float32)
                f2 = tl.zeros([LANES], tl.float32)
                f3 = tl.zeros([LANES], tl.float32)
                g1 = tl.zeros([LANES], tl.float32)
                g2 = tl.zeros([LANES], tl.float32)
                g3 = tl.zeros([LANES], tl.float32)
                n1 = tl.zeros([LANES], tl.int32)
                n2 = tl.zeros([LANES], tl.int32)
                n3 = tl.zeros([LANES], tl.int32)
                b_lo = tl.full([LANES], float("inf"), tl.float32)
                b_hi = tl.full([LANES], float("-inf"), tl.float32)
                if n_s == 0:
                    # the row: masses above q1 (those above hi too), the window's keys
                    base = f_hi * 0.0
                    g_base = base
                    w = tl.zeros([LANES], tl.int32)  # each lane's keys written
                    for v0 in tl.range(0, V, STEP, num_stages=BRACKET_STAGES):
                        offs = v0 + cols
                        _, r = _z(row_ptr, offs, V, inv_t, softcap, HAS_SOFTCAP)
                        e = tl.where(r > q1, tl.exp(r - m), 0.0)
                        (f1, f2, f3, g1, g2, g3, n1, n2, n3, b_lo, b_hi) = _tally(
                            r, e, (r > lo) & (r <= hi), q1, q2, q3, m, f1, f2, f3,
                            g1, g2, g3, n1, n2, n3, b_lo, b_hi)
                        win = (r > w_lo) & (r <= w_hi)
                        h = win.to(tl.int32)
                        at = w[:, None] + tl.cumsum(h, axis=1)  # 1 + the slot in the lane's
                        tl.store(scr + region[:, None] + at - 1, _sort_key(r, offs),
                                 mask=win & (at <= R))
                        w += tl.sum(h, axis=1)
                    # the regions' rest empty; a region too small: the window unwritten
                    j = tl.arange(0, R)[None, :]
                    tl.store(scr + region[:, None] + j, _EMPTY, mask=j >= w[:, None])
                    fits = tl.max(w, axis=0) <= R
                    tl.debug_barrier()  # its stores before the next sweep's and reads
                else:
                    # the scratch: the bracket's masses, added to f(hi)
                    base = f_hi
                    g_base = g_hi
                    fits = n_s > 0
                    for v0 in range(0, CAP, STEP):
                        r, _, ok = _entry(row_ptr, scr, v0 + cols, CAP, V, inv_t,
                                          softcap, HAS_SOFTCAP)
                        inside = ok & (r > lo) & (r <= hi)
                        e = tl.where(inside & (r > q1), tl.exp(r - m), 0.0)
                        (f1, f2, f3, g1, g2, g3, n1, n2, n3, b_lo, b_hi) = _tally(
                            r, e, inside, q1, q2, q3, m, f1, f2, f3, g1, g2, g3, n1,
                            n2, n3, b_lo, b_hi)
                f1 = base + tl.sum(f1, axis=0)
                f2 = base + tl.sum(f2, axis=0)
                f3 = base + tl.sum(f3, axis=0)
                g1 = g_base + tl.sum(g1, axis=0)
                g2 = g_base + tl.sum(g2, axis=0)
                g3 = g_base + tl.sum(g3, axis=0)
                n1 = tl.sum(n1, axis=0)
                n2 = tl.sum(n2, axis=0)
                n3 = tl.sum(n3, axis=0)
                b_lo = tl.min(b_lo, axis=0)
                b_hi = tl.max(b_hi, axis=0)
                if b_lo == b_hi:  # the bracket's classes are ties at one value
                    hi = b_hi  # f(hi) is the same: no class in between
                    ties = n_in >= 0
                    go = n_in < 0
                else:
                    # v <= q iff f(q) < T: the first such point bounds the bracket
                    first = near & (step == 0)
                    miss = n_in * 0
                    if f1 < target_mass:
                        hi = q1
                        f_hi = f1
                        g_hi = g1
                        n_in = n_in - n1
                        miss = tl.where(first, -1, 0)
                    elif f2 < target_mass:
                        lo = q1
                        hi = q2
                        f_hi = f2
                        g_hi = g2
                        n_in = n1 - n2
                    elif f3 < target_mass:
                        lo = q2
                        hi = q3
                        f_hi = f3
                        g_hi = g3
                        n_in = n2 - n3
                    else:
                        lo = q3
                        n_in = n3
                        miss = tl.where(first, 1, 0)
                    # the scratch holds the bracket: a sweep of the row wrote its window
                    n_s = tl.where((n_s == 0) & fits & (lo >= w_lo) & (hi <= w_hi), 1, n_s)
                    # the ends drawn in to the bracket's values (no class between: f holds)
                    lo = tl.maximum(lo, _below(b_lo))
                    hi = tl.minimum(hi, b_hi)
                step += 1
        failed = go & (n_in > C)  # never, by the bound above: a NaN, not a wrong K
        n_src = tl.where(n_s > 0, CAP, V)
        if go:
            # the bracket's classes' sort keys to the C slots (a lane's at a counter's
            # slots: any order, the sort orders them), a sort of them
            tl.store(cnt, 0)
            tl.debug_barrier()  # the counter's zero before its additions
            for v0 in range(0, n_src, STEP):
                r, cls, ok = _entry(row_ptr, scr, v0 + cols, tl.where(n_s > 0, CAP, 0), V,
                                    inv_t, softcap, HAS_SOFTCAP)
                hit = ok & (r > lo) & (r <= hi)
                h = hit.to(tl.int32)
                k = tl.sum(h, axis=1)
                first = tl.atomic_add(cnt + region * 0, k, mask=k > 0)
                slot = first[:, None] + tl.cumsum(h, axis=1) - 1
                tl.store(buf + slot, _sort_key(r, cls), mask=hit & (slot < C))
            tl.debug_barrier()  # the slots' stores before their loads
            j = tl.arange(0, C)
            keys = tl.sort(tl.load(buf + j, mask=j < n_in, other=_EMPTY), descending=True)
            valid = j < n_in
            vals = _unkey((keys >> 32).to(tl.int32))
            mass = tl.where(valid, tl.exp(vals - m), 0.0)
            before = f_hi + tl.cumsum(mass, axis=0) - mass
            kept = valid & (before < target_mass)
            last = tl.sum(kept.to(tl.int32), axis=0) - 1
            v = tl.sum(tl.where(j == last, vals, 0.0), axis=0)
            c = tl.sum(tl.where(j == last, 0x7FFFFFFF - (keys & 0x7FFFFFFF), 0),
                       axis=0).to(tl.float32)
            s_k = f_hi + tl.sum(tl.where(kept, mass, 0.0), axis=0)
            g_k = g_hi + tl.sum(tl.where(kept & (mass > 0.0), mass * (vals - m), 0.0),
                                axis=0)
        if ties:
            # the bracket is ties at hi: the first n_keep of them by class while the
            # mass before each is < T, the last one's class found by a sweep of the row
            e_t = tl.exp(hi - m)
            n_keep = tl.minimum(tl.maximum(tl.ceil((target_mass - f_hi) / e_t), 1.0),
                                n_in.to(tl.float32)).to(tl.int32)
            seen = n_keep * 0
            last = n_keep * 0
            for v0 in range(0, V, STEP):
                r, cls, ok = _entry(row_ptr, scr, v0 + cols, 0, V, inv_t, softcap,
                                    HAS_SOFTCAP)
                tie = ok & (r == hi)
                at = tie & (_slots(tie, seen) + 1 == n_keep)
                last = tl.maximum(last, tl.max(tl.max(tl.where(at, cls, 0), axis=1), axis=0))
                seen += tl.sum(tl.sum(tie.to(tl.int32), axis=1), axis=0)
            v = hi
            c = last.to(tl.float32)
            s_k = f_hi + n_keep.to(tl.float32) * e_t
            g_k = g_hi + tl.where(e_t > 0.0, n_keep.to(tl.float32) * e_t * (hi - m), 0.0)
        s_k = tl.where(failed, float("nan"), s_k)
    s_k = tl.where(s == s, s_k, s)  # a NaN in the row: its sums NaN

    y = tl.load(target_ptr + row).to(tl.int64)
    read = (y != ignore_index) & (y >= 0) & (y < V)
    z_y = _load_z(row_ptr + tl.where(read, y, 0), True, softcap, HAS_SOFTCAP) * inv_t
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, s_k)
    tl.store(out + 3, g_k)
    tl.store(out + 4, v)
    tl.store(out + 5, c)
    tl.store(out + 6, argmax.to(tl.float32))
    tl.store(out + 7, tl.where(read, z_y, 0.0))


@triton.jit
def _gather_z_kernel(logits_ptr, idx_ptr, inv_t_ptr, out_ptr, V, k, stride_ln, softcap,
                     HAS_SOFTCAP: tl.constexpr, BLOCK_K: tl.constexpr):
    """out (n, k) <- z = softcap(l) * inv_t at the classes idx (n, k) of each row, with
    the gradient sweep's formula (so its threshold test sees these bits); 0 where a
    class is outside [0, V)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    inside = offs < k
    j = tl.load(idx_ptr + row * k + offs, mask=inside, other=0)
    read = inside & (j >= 0) & (j < V)
    c = _load_z(logits_ptr + row * stride_ln + tl.where(read, j, 0), read, softcap,
                HAS_SOFTCAP)
    z = c * tl.load(inv_t_ptr + row)
    tl.store(out_ptr + row * k + offs, tl.where(read, z, 0.0), mask=inside)


@triton.jit
def _processed_kernel(logits_ptr, inv_t_ptr, z_ptr, part_ptr, V, NB, stride_ln, softcap,
                      HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """z (n, V) float32 <- softcap(l) * inv_t, the gradient sweep's formula (so a
    shard's search sees its bits), and part (n, NB, 3) float32: each block's largest z
    (NaN as -inf), its first class, and 1 where it holds a NaN; programs (row, block of
    BLOCK_V classes)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < V
    z, r = _z(logits_ptr + row * stride_ln, offs, V, tl.load(inv_t_ptr + row), softcap,
              HAS_SOFTCAP)  # (r past V: -inf)
    tl.store(z_ptr + row * V + offs, z, mask=inside)
    top = tl.max(r, axis=0)
    first = tl.min(tl.where(inside & (r == top), offs, V), axis=0)
    out = part_ptr + (row * NB + block) * 3
    tl.store(out, top)
    tl.store(out + 1, first.to(tl.float32))
    tl.store(out + 2, tl.max((z != z).to(tl.float32), axis=0))


@triton.jit
def _span_sums(z_ptr, t, top, row, span, V, P: tl.constexpr, BLOCK_V: tl.constexpr,
               SPAN: tl.constexpr):
    """A span's count of its classes with z > t (P,), their mass exp(z - top) and its
    exp(z - top) (z - top): sums kept per class slot, reduced once at the end."""
    cnt = tl.zeros([P, BLOCK_V], tl.int32)
    mass = tl.zeros([P, BLOCK_V], tl.float32)
    g = tl.zeros([P, BLOCK_V], tl.float32)
    for v0 in range(0, SPAN, BLOCK_V):
        offs = span * SPAN + v0 + tl.arange(0, BLOCK_V)
        z = tl.load(z_ptr + row * V + offs, mask=offs < V, other=float("-inf"))
        up = z[None, :] > t[:, None]  # (NaN: never)
        e = tl.exp(z - top)
        ex = tl.where(e > 0.0, e * (z - top), 0.0)
        cnt += up.to(tl.int32)
        mass += tl.where(up, e[None, :], 0.0)
        g += tl.where(up, ex[None, :], 0.0)
    return tl.sum(cnt, axis=1).to(tl.float32), tl.sum(mass, axis=1), tl.sum(g, axis=1)


@triton.jit
def _tally_kernel(z_ptr, t_ptr, top_ptr, out_ptr, V, S, P: tl.constexpr,
                  BLOCK_V: tl.constexpr, SPAN: tl.constexpr):
    """out (n, S, 3, P) float32: per row and span of SPAN classes _span_sums for the
    row's P values t (n, P). Programs (row, span): a shard's chunk holds few rows, so
    one program a row would leave most of the GPU idle."""
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    j = tl.arange(0, P)
    cnt, mass, g = _span_sums(z_ptr, tl.load(t_ptr + row * P + j), tl.load(top_ptr + row),
                              row, span, V, P, BLOCK_V, SPAN)
    out = out_ptr + (row * S + span) * 3 * P
    tl.store(out + j, cnt)
    tl.store(out + P + j, mass)
    tl.store(out + 2 * P + j, g)


@triton.jit
def _eighths(lo, hi, j):
    """truncation.eighths in a kernel: the points lo < .. <= hi (int64 images) at
    j + 1 eighths of (lo, hi], j = 0 .. 6 (7: unused; near hi, on either side)."""
    k = (j + 1).to(tl.int64)
    eighth = (hi >> 3) - (lo >> 3)
    d = tl.minimum(eighth, 16) * 8 + ((hi & 7) - (lo & 7))
    return tl.where(eighth < 16, lo + tl.maximum(k * d // 8, 1), lo + k * eighth)


@triton.jit
def _search_kernel(z_ptr, top_ptr, state_ptr, h_ptr, goal_ptr, out_ptr, next_ptr, V, S,
                   FIRST: tl.constexpr, MASS: tl.constexpr, BLOCK_V: tl.constexpr,
                   SPAN: tl.constexpr):
    """A round of truncation._smallest_below, programs (row, span): the bracket (lo, hi]
    of images in state (n, 2) int64 narrowed at the last round's points by its reduced
    H there (h (n, 8); not in the FIRST round) and stored to next (by span 0), then
    this round's points' span sums of the count (MASS: the mass) to out (n, S, 8)."""
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    j = tl.arange(0, 8)
    lo = tl.load(state_ptr + row * 2)
    hi = tl.load(state_ptr + row * 2 + 1)
    if not FIRST:  # (every program alike: the same bracket)
        points = _eighths(lo, hi, j)
        point = j < 7
        under = point & (tl.load(h_ptr + row * 8 + j) < tl.load(goal_ptr + row))
        lo, hi = (tl.max(tl.where(under | ~point, lo, points), axis=0),
                  tl.min(tl.where(under, points, hi), axis=0))
    if span == 0:
        tl.store(next_ptr + row * 2, lo)
        tl.store(next_ptr + row * 2 + 1, hi)
    bits = _eighths(lo, hi, j)
    bits = tl.where(bits < 0, -2147483648 - bits, bits).to(tl.int32)  # truncation._from_image
    t = tl.where(j < 7, bits.to(tl.float32, bitcast=True), float("inf"))
    cnt, mass, _ = _span_sums(z_ptr, t, tl.load(top_ptr + row), row, span, V, 8, BLOCK_V,
                              SPAN)
    tl.store(out_ptr + (row * S + span) * 8 + j, mass if MASS else cnt)


def triton_processed(logits, opts, inv_t, math_dtype):
    """TruncationRows.processed on the Triton kernel: the gradient sweep's z, its first
    maxima from the blocks' ones."""
    assert math_dtype == torch.float32 and logits.stride(1) == 1
    n, V = logits.shape
    NB = triton.cdiv(V, _BLOCK)
    z = torch.empty((n, V), dtype=torch.float32, device=logits.device)
    part = z.new_empty((n, NB, 3))
    if n and V:
        _processed_kernel[(n, NB)](
            logits, inv_t.float().contiguous(), z, part, V, NB, logits.stride(0),
            float(opts.softcap or 1.0), HAS_SOFTCAP=opts.softcap is not None,
            BLOCK_V=_BLOCK, num_warps=_WARPS)
    top, first, nan = part.unbind(-1)
    mine = top.amax(-1)
    col = torch.where(top == mine[:, None], first, V).amin(-1).long()
    return z, mine, col, torch.where(nan.amax(-1) > 0, math.nan, mine)


_TALLY_P = 8  # the tally's values a sweep (the search asks for 1 to 7)
_TALLY_BLOCK, _TALLY_SPAN = 512, 16384  # its step's classes, a program's


def _spans(V):
    """The tally's (step, span, spans) over V classes (a narrow shard: one span)."""
    block = min(_TALLY_BLOCK, triton.next_power_of_2(max(V, 1)))
    span = min(_TALLY_SPAN, triton.cdiv(max(V, 1), block) * block)
    return block, span, triton.cdiv(V, span)


def triton_tally(z, top, search):
    """TruncationRows.tally on the Triton kernel: a sweep of the shard's z per query, its
    spans' sums added in a fixed order (the same bits in any batch), search or not."""
    n, V = z.shape
    top = top.float().contiguous()
    block, span, S = _spans(V)

    def above(t):
        P = t.shape[1]
        pad = t.new_full((n, _TALLY_P), math.inf)  # (nothing above +inf)
        pad[:, :P] = t
        out = z.new_empty((n, S, 3, _TALLY_P))
        if n and V:
            _tally_kernel[(n, S)](z, pad, top, out, V, S, P=_TALLY_P,
                                  BLOCK_V=block, SPAN=span, num_warps=_WARPS)
        out = out.sum(1)
        return out[:, 0, :P], out[:, 1, :P], out[:, 2, :P]
    return above


def triton_search(z, top, lo, goal, mass, reduce):
    """TruncationRows.search on the Triton kernel: each round one launch (the last
    round's narrowing, this one's points and their span sums, _search_kernel), the
    spans' sum and reduce (no PyTorch step of its own a round: a shard's chunk holds few
    rows, so the rounds' small steps, not their sweeps, set the search's time); the
    span sums _tally_kernel's, so H at a value is the tally's."""
    n, V = z.shape
    block, span, S = _spans(V)
    S = max(S, 1)  # (an empty shard still runs every round's bracket and reduce)
    state = torch.stack([image_of(lo.float()) - 1, image_of(top.float())], 1).contiguous()
    top, goal = top.float().contiguous(), goal.float().contiguous()
    h = z.new_zeros((n, 8))  # the last round's reduced H at its points
    out = z.new_empty((n, S, 8))
    spare = torch.empty_like(state)
    for r in range(search_rounds(torch.float32)):
        if n:
            _search_kernel[(n, S)](z, top, state, h, goal, out, spare, V, S, FIRST=r == 0,
                                   MASS=mass, BLOCK_V=block, SPAN=span, num_warps=_WARPS)
        h = reduce(out.sum(1))
        state, spare = spare, state
    _, hi = narrowed(state[:, 0], state[:, 1], eighths(state[:, 0], state[:, 1]),
                     h[:, :7] < goal[:, None])
    return value_of_image(hi, torch.float32)


def triton_candidates(logits, target, inv_t, opts, math_dtype, shard):
    """TruncationRows.candidates on the Triton kernels (top_k <= 256, one device or a
    vocabulary shard): the top-k rows' classes and target log-prob (a shard's: the
    group's, merged), then the candidates' and the target's z gathered by
    _gather_z_kernel (on a shard from the rank holding each, the others' 0 summed)."""
    assert math_dtype == torch.float32 and logits.stride(1) == 1
    n, V = logits.shape
    classes, _, logprob = triton_topk_rows(
        logits, target, inv_t,
        TopKRecord(min(opts.top_k, V if shard.group is None else shard.vocab_size),
                   softcap=opts.softcap, ignore_index=opts.ignore_index),
        math_dtype, shard)
    valid = target != opts.ignore_index
    idx = torch.cat([classes, torch.where(valid, target, -1)[:, None]], 1)
    idx = torch.where(idx >= 0, idx - shard.vocab_start, -1).contiguous()  # local columns
    z = torch.empty(idx.shape, dtype=torch.float32, device=logits.device)
    if n:
        _gather_z_kernel[(n,)](logits, idx, inv_t.float().contiguous(), z, V, idx.shape[1],
                               logits.stride(0), float(opts.softcap or 1.0),
                               HAS_SOFTCAP=opts.softcap is not None,
                               BLOCK_K=triton.next_power_of_2(idx.shape[1]))
    if shard.group is not None:
        z = shard.all_reduce(z, "sum")
    return z[:, :-1], classes, z[:, -1], logprob


def triton_kept_grad(logits, target, inv_t, opts, g_lp, g_h, row_stats, math_dtype, col0,
                     dz_dtype):
    """TruncationRows.grad: the log-probs' gradient sweep with the kept set's test."""
    assert math_dtype == torch.float32
    return _launch(logits, target, inv_t, opts, False, (g_lp, g_h, row_stats), col0,
                   dz=dz_buffer(logits, dz_dtype), truncated=True)[5]


def scratch_classes(vocab_size):
    """The scratch's classes a row: V / 8 at most (a byte a logit, rows.thresholds_per_logit)
    rounded down to a power of two, at most _CAP, and at least _C."""
    return max(_C, min(_CAP, 1 << max(vocab_size // 8, 1).bit_length() - 1))


def triton_threshold_stats(logits, target, inv_t, opts, math_dtype, slots=_C, cap=None):
    """TruncationRows.thresholds (truncation.py) on the Triton kernel, one
    device: kept_stats' outputs under top_p and min_p without a top-k. slots and cap
    (the sort's classes, the scratch's: scratch_classes(V) by default) for tests that
    take the rows through every path."""
    assert math_dtype == torch.float32 and logits.stride(1) == 1
    n, V = logits.shape
    cap = scratch_classes(V) if cap is None else cap
    out = logits.new_empty((n, 8), dtype=torch.float32)
    lanes = max(min(min(_block_v(V), _BLOCK) // _U, cap), 1)  # a lane's scratch region >= 1
    if n:
        top_p = opts.top_p if opts.top_p not in (None, 1.0) else None
        min_p = opts.min_p if opts.min_p not in (None, 0.0) else None
        _threshold_kernel[(n,)](
            logits, target.contiguous(), inv_t.float().contiguous(),
            logits.new_empty((n, slots), dtype=torch.int64),
            logits.new_empty((n, cap), dtype=torch.int64), out,
            logits.new_empty(n, dtype=torch.int32), V, opts.ignore_index,
            float(top_p or 1.0), math.log(min_p or 1.0),
            float(opts.softcap or 1.0), logits.stride(0),
            HAS_SOFTCAP=opts.softcap is not None, HAS_TOP_P=top_p is not None,
            HAS_MIN_P=min_p is not None, LANES=lanes, U=_U, C=slots, CAP=cap,
            VALUE_STEPS=_VALUE_STEPS, STAGES=_STAGES, BRACKET_STAGES=_BRACKET_STAGES,
            num_warps=_WARPS)
    m, s, s_k, g_k, v, c, argmax, z_y = out.unbind(1)
    return kept_outputs(m, s_k, g_k, v, c, z_y, (z_y - m) - s.log(), argmax.long(), target,
                        opts, V)


# threshold kernel's scratch: a byte a logit at most (scratch_classes); a shard's
# search: its z, and float32, bool and int32 temporaries of a chunk's shape (the
# largest: the first maxima's and the last tie's)
TRITON_TRUNCATION_ROWS = TruncationRows(triton_candidates, triton_kept_grad, 0,
                                        triton_threshold_stats, 1, triton_processed,
                                        triton_tally, 16, triton_search)

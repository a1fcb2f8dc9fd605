"""python -m torch_fce.bench distill: the student-teacher divergence of TRL's
DistillationTrainer (its generalized JSD at beta, temperature 1, the mean over the
tokens counted), forward + backward, torch_fce against its peers on the same inputs
(--parts divergence); the teacher's top-k and the student's sparse divergence over it
(--parts topk, sparse: bench/topk_distill.py says what they run).

Per (student D, beta): bf16 inputs, N tokens of which 10% are not counted (target
-100), V classes, the teacher's hidden size --Dt. Methods:
- fce: torch_fce.linear_distillation_loss at its default (float32 logits);
  fce-bf16logits: its logits rounded to bf16 (logits_dtype=None);
- eager, compile: the unfused composition (bf16 logits, float32 softmaxes), eager and
  through torch.compile;
- trl: TRL 1.16's trl.kernels.chunked_divergence.ChunkedDivergenceFunction as its
  DistillationTrainer calls it (the counted rows compacted outside the timed step, which
  spares it the trainer's host sync and the ignored tenth of the work);
- liger: Liger's LigerFusedLinearJSD at its defaults, where installed.
Each prints the median time of --reps steps, the time over one bf16 (N, D) x (D, V)
matmul of the same run ("x mm"), the peak memory beyond the inputs (gradients
included) and how far the student's hidden and weight gradients point from a float32
composition of the same bf16 inputs (float32 logits; direction error ||a/|a| - e/|e||).
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench.env import describe, environment
from torch_fce.bench.measure import (add_device_option, add_size_options, check_device,
                                     median_time, peak_extra_bytes)
from torch_fce.bench.topk_distill import (SPARSE_METHODS, TOPK_METHODS, measure_sparse,
                                          measure_topk)
from torch_fce.testing import rel_err

IGNORED = 0.1  # the share of tokens not counted


def _divergence(zs, zt, beta):
    """TRL's generalized JSD per token from both heads' logits (its formulas)."""
    lq, lp = zs.log_softmax(-1), zt.log_softmax(-1)
    if beta == 0.0:
        return (lp.exp() * (lp - lq)).sum(-1)
    if beta == 1.0:
        return (lq.exp() * (lq - lp)).sum(-1)
    lm = torch.logsumexp(torch.stack([lq + math.log(1 - beta), lp + math.log(beta)]), 0)
    return beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)


def _mean(per, t):
    valid = t != -100
    return torch.where(valid, per, 0.0).sum() / valid.sum().clamp(min=1)


def _unfused(beta):
    def loss(h, w, ht, wt, t):
        return _mean(_divergence(F.linear(h, w).float(), F.linear(ht, wt).float(), beta), t)
    return loss


def _fce(beta, logits_dtype=torch.float32):
    def loss(h, w, ht, wt, t):
        return torch_fce.linear_distillation_loss(h, w, ht, wt, t, beta=beta,
                                                  logits_dtype=logits_dtype)[0]
    return loss


def _trl(beta):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    def loss(h, w, ht, wt, t, compact):  # compact: the counted rows and their count
        rows, count = compact
        div, _ = ChunkedDivergenceFunction.apply(h[rows], w, None, ht[rows], wt, None, beta,
                                                 1.0, 1.0, None, 1.0, None)
        return div.sum() / count
    return loss


def _liger(beta):
    from liger_kernel.transformers import LigerFusedLinearJSD

    jsd = LigerFusedLinearJSD(jsd_beta=beta, ignore_index=-100, temperature=1.0)
    return lambda h, w, ht, wt, t: jsd(h, w, ht, wt, t)


METHODS = {"fce": _fce, "fce-bf16logits": lambda b: _fce(b, None), "eager": _unfused,
           "compile": lambda b: torch.compile(_unfused(b), fullgraph=True, dynamic=False),
           "trl": _trl, "liger": _liger}

DEFAULT_METHODS = "fce,fce-bf16logits,compile,trl,liger"
PARTS = ("divergence", "topk", "sparse")


def _inputs(args, D, device):
    g = torch.Generator(device="cpu").manual_seed(D)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, _dtype(device))

    N, V, Dt = args.N, args.V, args.Dt
    h, w = r(N, D), r(V, D, scale=3.0 / D ** 0.5)  # logits of std about 3, both heads
    ht, wt = r(N, Dt), r(V, Dt, scale=3.0 / Dt ** 0.5)
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < IGNORED] = -100
    return h, w, ht, wt, t.to(device)


def _dtype(device):
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def reference_grads(h, w, ht, wt, t, beta, rows=1024):
    """(dh, dW) of the mean divergence from float32 logits of the same inputs, summed
    over token chunks (bounded memory)."""
    hf, wf = h.float(), w.float().requires_grad_()
    count = (t != -100).sum().clamp(min=1)
    dh = torch.empty_like(hf)
    for s in range(0, h.shape[0], rows):
        hc = hf[s:s + rows].clone().requires_grad_()
        with torch.no_grad():
            zt = ht[s:s + rows].float() @ wt.float().T
        per = _divergence(hc @ wf.T, zt, beta)
        loss = torch.where(t[s:s + rows] != -100, per, 0.0).sum() / count
        loss.backward()
        dh[s:s + rows] = hc.grad
    return dh, wf.grad


def _direction_error(a, e):
    a, e = a.double(), e.double()
    return rel_err(a / a.norm(), e / e.norm())


def measure(args, D, beta, device):
    """One row per method: time, x mm, peak extra MiB and both gradients' errors."""
    h, w, ht, wt, t = _inputs(args, D, device)
    want = reference_grads(h, w, ht, wt, t, beta) if args.errors else None
    mm = median_time(lambda: h @ w.T, device, reps=args.reps)
    valid = t != -100
    compact = (valid.nonzero().squeeze(1), valid.sum())
    out = []
    for name in args.methods:
        try:
            fn = METHODS[name](beta)
        except ImportError as e:
            print(f"  {name}: skipped ({e})")
            continue
        extra = (compact,) if name == "trl" else ()
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

        def step():
            loss = fn(*leaves, ht, wt, t, *extra)
            return torch.autograd.grad(loss, leaves)

        grads = step()  # also the warm-up (torch.compile compiles here)
        sec = median_time(step, device, reps=args.reps)
        peak = peak_extra_bytes(step, device) / 2**20
        row = dict(method=name, D=D, beta=beta, ms=sec * 1e3, x_mm=sec / mm, peak_mib=peak)
        if want is not None:
            row.update(dh_err=_direction_error(grads[0], want[0]),
                       dw_err=_direction_error(grads[1], want[1]))
        out.append(row)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
        del grads
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m torch_fce.bench distill",
                                     description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    add_size_options(parser, N=(16384, "tokens"), V=(151936, "classes"),
                     Dt=(4096, "the teacher's hidden size"),
                     reps=(10, "timed steps per method (median)"))
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--student-dims", default="1024,2048",
                        help="the students' hidden sizes (default: 1024,2048; sparse: the "
                             "first)")
    parser.add_argument("--betas", default="0,0.5,1",
                        help="the divergence's betas (default: 0,0.5,1)")
    parser.add_argument("--methods",
                        help=f"comma-separated, each part running those of its own: the "
                             f"divergence's {', '.join(METHODS)} (default: "
                             f"{DEFAULT_METHODS}), topk's {', '.join(TOPK_METHODS)}, "
                             f"sparse's {', '.join(SPARSE_METHODS)} (default: all)")
    parser.add_argument("--teacher-dims", default="4096,1536",
                        help="topk: the teachers' hidden sizes (default: 4096,1536)")
    parser.add_argument("--ks", default="8,64,128", help="topk: the k (default: 8,64,128)")
    parser.add_argument("--supports", default="8,64",
                        help="sparse: the support sizes K (default: 8,64)")
    parser.add_argument("--sparse-betas", default="0,0.5",
                        help="sparse: the betas, each with tail off and on (default: 0,0.5)")
    parser.add_argument("--no-errors", dest="errors", action="store_false",
                        help="skip the float32 reference and the gradients' errors "
                             "(default: measured)")
    parser.add_argument("--json", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    chosen = None if args.methods is None else args.methods.split(",")
    for m in chosen or ():
        if m not in {**METHODS, **TOPK_METHODS, **SPARSE_METHODS}:
            parser.error(f"--methods: unknown method {m!r} (of {', '.join(METHODS)}, "
                         f"{', '.join(TOPK_METHODS)}, {', '.join(SPARSE_METHODS)})")
    args.methods = DEFAULT_METHODS.split(",") if chosen is None else \
        [m for m in chosen if m in METHODS]
    topk_methods, sparse_methods = (
        list(table) if chosen is None else [m for m in chosen if m in table]
        for table in (TOPK_METHODS, SPARSE_METHODS))
    parts = args.parts.split(",")
    for p in parts:
        if p not in PARTS:
            parser.error(f"--parts: unknown part {p!r} (of {', '.join(PARTS)})")
    try:
        dims = [int(d) for d in args.student_dims.split(",")]
        teacher_dims = [int(d) for d in args.teacher_dims.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
        supports = [int(k) for k in args.supports.split(",")]
        betas = [float(b) for b in args.betas.split(",")]
        sparse_betas = [float(b) for b in args.sparse_betas.split(",")]
    except ValueError as e:
        parser.error(f"--student-dims / --teacher-dims / --ks / --supports / --betas / "
                     f"--sparse-betas: {e}")
    for name in ("N", "V", "Dt", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not all(0.0 <= b <= 1.0 for b in betas + sparse_betas):
        parser.error(f"--betas and --sparse-betas must lie in [0, 1], got {args.betas}, "
                     f"{args.sparse_betas}")
    if not all(1 <= k <= min(256, args.V) for k in ks + supports):
        parser.error(f"--ks and --supports must lie in [1, min(256, V)], got {args.ks}, "
                     f"{args.supports}")
    env = environment()
    print(describe(env))
    rows = []
    if "divergence" in parts:
        for D in dims:
            for beta in betas:
                print(f"N={args.N} V={args.V} D={D} teacher D={args.Dt} beta={beta}",
                      flush=True)
                rows += measure(args, D, beta, args.device)
    if "topk" in parts:
        for D in teacher_dims:
            for k in ks:
                print(f"topk: N={args.N} V={args.V} teacher D={D} k={k}", flush=True)
                rows += measure_topk(args, D, k, args.device, topk_methods)
    if "sparse" in parts:
        for K in supports:
            for beta in sparse_betas:
                for tail in (False, True):
                    print(f"sparse: N={args.N} V={args.V} D={dims[0]} K={K} beta={beta} "
                          f"tail={tail}", flush=True)
                    rows += measure_sparse(args, dims[0], K, tail, beta, args.device,
                                           sparse_methods)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, args=vars(args), rows=rows),
                      f, indent=1)

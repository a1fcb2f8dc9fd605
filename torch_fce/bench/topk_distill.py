"""The top-k distillation parts of `python -m torch_fce.bench distill`: a teacher's top-k
log-probs from its head (--parts topk) and the student's sparse divergence over them
(--parts sparse), torch_fce against the unfused compositions, eager and compiled.

topk, per (teacher D, k), forward only, bf16 (N, D) x (D, V):
- fce: torch_fce.linear_topk_logprobs (float32 logits, its default); fce-bf16logits: its
  logits rounded to bf16 (logits_dtype=None), as the unfused composition's;
- eager, compile: F.linear, float32 log_softmax, torch.topk, eager and through
  torch.compile.
sparse, per (K, tail, beta), forward + backward of the student (N, --student-dims) on a
teacher's top-K (synthetic: K random classes per token holding 90% of the teacher's
mass; 10% of the tokens not counted):
- fce: torch_fce.linear_sparse_divergence;
- eager, compile: the loss as TRL 1.16's server distillation trainer forms it (float32
  logits, full log_softmax, gather, the tail bucket or the renormalisation, the
  generalized JSD, the mean over the tokens counted), eager and compiled;
- ce: torch_fce.linear_cross_entropy on the same head (the time the sparse loss is held
  to).
Each prints the median time, the time over one bf16 logits matmul of the same run
("x mm"), the peak memory beyond the inputs; sparse also the hidden and weight
gradients' direction errors against the float32 composition.
"""

import math

import torch
import torch.nn.functional as F

import torch_fce
from torch_fce.bench.measure import median_time, peak_extra_bytes
from torch_fce.testing import rel_err

IGNORED = 0.1  # the share of tokens not counted
TEACHER_MASS = 0.9  # the teacher's mass on its top-K


def _topk_unfused(k):
    def topk(h, w):
        lp = F.linear(h, w).float().log_softmax(-1)
        values, indices = torch.topk(lp, k, dim=-1)
        return indices, values
    return topk


def _topk_fce(k, logits_dtype=torch.float32):
    return lambda h, w: torch_fce.linear_topk_logprobs(h, w, k, logits_dtype=logits_dtype)[:2]


TOPK_METHODS = {"fce": _topk_fce, "fce-bf16logits": lambda k: _topk_fce(k, None),
                "eager": _topk_unfused,
                "compile": lambda k: torch.compile(_topk_unfused(k), fullgraph=True,
                                                   dynamic=False)}


def _trl_sparse(tail, beta):
    """TRL 1.16's server trainer's sparse loss from the student's full float32
    log-softmax (_compute_server_forward_kl_loss, _add_tail_bucket, _jsd_divergence)."""
    def with_tail(lp):
        log_sum = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(log_sum))], -1)

    def loss(h, w, support, t_lp, valid):
        s = F.linear(h, w).float().log_softmax(-1).gather(-1, support)
        t = t_lp
        if tail:
            s, t = with_tail(s), with_tail(t)
        else:
            s, t = s.log_softmax(-1), t.log_softmax(-1)
        if beta == 0.0:
            div = (t.exp() * (t - s)).sum(-1)
        elif beta == 1.0:
            div = (s.exp() * (s - t)).sum(-1)
        else:
            m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
            div = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
        return torch.where(valid, div, 0.0).sum() / valid.sum().clamp(min=1)
    return loss


def _sparse_fce(tail, beta):
    def loss(h, w, support, t_lp, valid):
        weights = valid / valid.sum().clamp(min=1)
        return torch_fce.linear_sparse_divergence(h, w, support, t_lp, tail=tail, beta=beta,
                                                  token_weights=weights)[0]
    return loss


def _ce(tail, beta):
    return lambda h, w, support, t_lp, valid: torch_fce.linear_cross_entropy(
        h, w, torch.where(valid, support[:, 0], -100))


SPARSE_METHODS = {"fce": _sparse_fce, "eager": _trl_sparse,
                  "compile": lambda tail, beta: torch.compile(_trl_sparse(tail, beta),
                                                              fullgraph=True, dynamic=False),
                  "ce": _ce}


def _head(N, D, V, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    h = torch.randn(N, D, generator=g).to(device, dtype)
    w = (torch.randn(V, D, generator=g) * 3.0 / D ** 0.5).to(device, dtype)  # logits ~ 3
    return h, w, g


def _print(row):
    print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)


def measure_topk(args, D, k, device, methods):
    """One row per method: time, x mm, peak extra MiB, and the share of rows whose
    classes (in order) are fce's (near-ties of bf16 logits may order otherwise)."""
    h, w, _ = _head(args.N, D, args.V, device, D)
    mm = median_time(lambda: h @ w.T, device, reps=args.reps)
    out, ours = [], None
    for name in methods:
        fn = TOPK_METHODS[name](k)
        with torch.no_grad():
            got = fn(h, w)  # also the warm-up (torch.compile compiles here)
            sec = median_time(lambda: fn(h, w), device, reps=args.reps)
            peak = peak_extra_bytes(lambda: fn(h, w), device) / 2**20
        ours = got[0] if name == "fce" else ours
        row = dict(part="topk", method=name, D=D, k=k, ms=sec * 1e3, x_mm=sec / mm,
                   peak_mib=peak)
        if ours is not None and name != "fce":  # bf16 logits: near-ties may reorder
            row["same_classes"] = float((got[0] == ours).all(-1).float().mean())
        out.append(row)
        _print(row)
        del got
    return out


def _reference_grads(h, w, support, t_lp, valid, tail, beta, rows=1024):
    """(dh, dW) of the TRL composition from float32 logits, over token chunks."""
    hf, wf = h.float(), w.float().requires_grad_()
    dh = torch.empty_like(hf)
    count = valid.sum().clamp(min=1)
    loss_fn = _trl_sparse(tail, beta)
    for s in range(0, h.shape[0], rows):
        hc = hf[s:s + rows].clone().requires_grad_()
        v = valid[s:s + rows]
        (loss_fn(hc, wf, support[s:s + rows], t_lp[s:s + rows], v) *
         v.sum().clamp(min=1) / count).backward()
        dh[s:s + rows] = hc.grad
    return dh, wf.grad


def _direction_error(a, e):
    a, e = a.double(), e.double()
    return rel_err(a / a.norm(), e / e.norm())


def measure_sparse(args, D, K, tail, beta, device, methods):
    """One row per method: time, x mm, peak extra MiB and both gradients' errors."""
    h, w, g = _head(args.N, D, args.V, device, D)
    support = torch.randint(0, args.V, (args.N, K), generator=g).to(device)
    t_lp = (torch.randn(args.N, K, generator=g).log_softmax(-1) +
            math.log(TEACHER_MASS)).to(device)
    valid = (torch.rand(args.N, generator=g) >= IGNORED).to(device)
    inputs = (support, t_lp, valid)
    want = _reference_grads(h, w, *inputs, tail, beta) if args.errors else None
    mm = median_time(lambda: h @ w.T, device, reps=args.reps)
    out = []
    for name in methods:
        fn = SPARSE_METHODS[name](tail, beta)
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

        def step():
            return torch.autograd.grad(fn(*leaves, *inputs), leaves)

        grads = step()  # also the warm-up
        sec = median_time(step, device, reps=args.reps)
        peak = peak_extra_bytes(step, device) / 2**20
        row = dict(part="sparse", method=name, D=D, K=K, tail=tail, beta=beta, ms=sec * 1e3,
                   x_mm=sec / mm, peak_mib=peak)
        if want is not None and name != "ce":
            row.update(dh_err=_direction_error(grads[0], want[0]),
                       dw_err=_direction_error(grads[1], want[1]))
        out.append(row)
        _print(row)
        del grads
    return out

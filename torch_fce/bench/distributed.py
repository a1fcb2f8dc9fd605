"""python -m torch_fce.bench distributed: a vocab-parallel op on 2+ GPUs, timed.

Spawns one process per GPU (NCCL, NVLink multicast off; `--device cpu`: gloo). On
each shape, every rank holds V / world rows of the head and the whole bf16 batch; per
rank it times, in one run: one bf16 (N, D) x (D, V / world) matmul, the single-GPU op
on the rank's share of the vocabulary (what the rank would cost alone), and the
vocab-parallel step (collectives included). Rank 0 also times the single-GPU op on the
whole vocabulary. `--op`: the cross entropy (fwd + bwd), the teacher's top-64
(forward) or the student's sparse divergence over a 64-class support with the tail
(fwd + bwd; the support random classes, the teacher's log-probs holding 90% of the
mass). Prints a table and writes JSON with --json.
"""

import argparse
import json
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_fce
from torch_fce.bench.env import describe, environment
from torch_fce.bench.shapes import SHAPES, Shape, shape_inputs
from torch_fce.distributed import (vocab_parallel_linear_cross_entropy,
                                   vocab_parallel_linear_sparse_divergence,
                                   vocab_parallel_linear_topk_logprobs)
from torch_fce.bench.measure import check_device, median_time, peak_extra_bytes


_K = 64  # the top-k's k and the sparse divergence's support


def _ops(op, t, support, teacher, start, end, V):
    """(one device, vocab-parallel, backward?) of --op, each fn(h, w, local) with local
    whether w is this rank's share alone (targets, support outside it ignored: a
    valid problem with the same GEMMs and row work, no collectives)."""
    def outside(x):
        return torch.where((x >= start) & (x < end), x - start, -100)

    if op == "ce":
        return (lambda h, w, local: torch_fce.linear_cross_entropy(
                    h, w, outside(t) if local else t),
                lambda h, w: vocab_parallel_linear_cross_entropy(h, w, t, vocab_start=start,
                                                                 vocab_size=V), True)
    if op == "topk":
        return (lambda h, w, local: torch_fce.linear_topk_logprobs(h, w, _K),
                lambda h, w: vocab_parallel_linear_topk_logprobs(h, w, _K, vocab_start=start,
                                                                 vocab_size=V), False)
    return (lambda h, w, local: torch_fce.linear_sparse_divergence(
                h, w, outside(support) if local else support, teacher, tail=True)[0],
            lambda h, w: vocab_parallel_linear_sparse_divergence(
                h, w, support, teacher, tail=True, vocab_start=start, vocab_size=V)[0], True)


def _step(fn, backward, h, w, *args):
    if not backward:
        return fn(h, w, *args)
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    fn(h, w, *args).backward()


def _shape(rank, world, s, reps, device, op):
    x = shape_inputs(s, device=device)
    start, end = s.V * rank // world, s.V * (rank + 1) // world
    h, w = x["hidden"], x["weight"][start:end].contiguous()
    g = torch.Generator().manual_seed(0)  # the same support on every rank
    support = torch.randint(0, s.V, (s.N, _K), generator=g).to(device)
    teacher = (torch.randn(s.N, _K, generator=g).log_softmax(-1) + math.log(0.9)).to(device)
    one, vp, backward = _ops(op, x["target"], support, teacher, start, end, s.V)
    row = dict(shape=s.name, N=s.N, D=s.D, V=s.V, world=world, op=op)
    row["mm_ms"] = median_time(lambda: h @ w.T, device, reps=reps) * 1e3
    row["op_shard_ms"] = median_time(lambda: _step(one, backward, h, w, True), device,
                                     reps=reps) * 1e3
    row["vp_ms"] = median_time(lambda: _step(vp, backward, h, w), device, reps=reps) * 1e3
    row["vp_extra_mib"] = peak_extra_bytes(lambda: _step(vp, backward, h, w), device) / 2**20
    dist.barrier()
    if rank == 0:
        row["op_full_ms"] = median_time(lambda: _step(one, backward, h, x["weight"], False),
                                        device, reps=reps) * 1e3
    dist.barrier()
    return row


def _worker(rank, world, path, shapes, reps, out, device, op):
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                world_size=world)
    try:
        rows = [_shape(rank, world, s, reps, device, op) for s in shapes]
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_fce.bench distributed",
                                description=__doc__)
    p.add_argument("--world", type=int, default=2, help="processes, one GPU each (default: 2)")
    p.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo) (default: cuda)")
    p.add_argument("--shapes", default="A,B,C", help="names (%s) or N:D:V (default: A,B,C)" % ",".join(SHAPES))
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default: 5)")
    p.add_argument("--op", default="ce", choices=("ce", "topk", "sparse"),
                   help="the cross entropy, the teacher's top-k or the sparse divergence "
                        "(default: ce)")
    p.add_argument("--json", default=None, help="write rows + environment to this file")
    args = p.parse_args(argv)
    check_device(p, args.device)
    shapes = [SHAPES[n] if n in SHAPES else Shape(n, *map(int, n.split(":")))
              for n in args.shapes.split(",")]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(_worker, args=(args.world, os.path.join(d, "store"), shapes, args.reps, out,
                                  args.device, args.op),
                 nprocs=args.world, join=True)
        with open(out) as f:
            per_rank = json.load(f)
    print(f"# {describe(environment())}, " + (
        f"{args.world} GPUs, NCCL, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}"
        if args.device == "cuda" else f"{args.world} CPU processes, gloo") + f", --op {args.op}")
    print(f"{'shape':6} {'rank':>4} {'mm ms':>8} {'op V/w ms':>10} {'vp ms':>8} "
          f"{'vp/op':>6} {'vp x mm':>8} {'vp MiB':>8} {'op full V ms':>13}")
    for rank, rows in enumerate(per_rank):
        for r in rows:
            print(f"{r['shape']:6} {rank:4d} {r['mm_ms']:8.2f} {r['op_shard_ms']:10.2f} "
                  f"{r['vp_ms']:8.2f} {r['vp_ms'] / r['op_shard_ms']:6.2f} "
                  f"{r['vp_ms'] / r['mm_ms']:8.2f} {r['vp_extra_mib']:8.0f} "
                  + (f"{r['op_full_ms']:13.2f}" if "op_full_ms" in r else f"{'-':>13}"))
    print("op full V: the single-device op on the whole head, timed on rank 0 only")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(), world=args.world, rows=per_rank), f,
                      indent=1)


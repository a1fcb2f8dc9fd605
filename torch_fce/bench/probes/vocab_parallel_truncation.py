"""What does the sampler's truncation cost vocab-parallel, and does it agree with one GPU?

Two processes, one GPU each (NCCL), each holding V / 2 rows of a bf16 head and the whole
batch (temperature 0.7): the vocab-parallel log-probs' forward untruncated, with
`top_k=50, top_p=0.95` (the shards' top-k candidates merged), and with `top_p=0.95`,
`min_p=0.05` or `top_k=1000` (no candidates: each rank's sort and the search of values,
linear_logprobs/truncation.sharded_kept_stats), median of 5 after a warm-up. Rank 0 also runs
the one-GPU op on the whole head (its Triton rows: candidates or threshold sweeps) and
counts the tokens whose target is kept by one and not the other (the masses are summed
in another order, so a boundary within rounding may fall either side) and the largest
log-prob difference where both keep it.

    python -m torch_fce.bench.probes.vocab_parallel_truncation [N:D:V] [--world W]
    (two CUDA GPUs by default; --world 1: a group of one, the shard path's own cost on
    one GPU without another rank's latency; --one-gpu: the ranks share cuda:0 over gloo,
    the shards' own kernels where one GPU is all there is; --device cpu: gloo on the CPU,
    a smoke run)
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_fce
from torch_fce.bench.gloo_cuda import stage_all_gathers
from torch_fce.bench.measure import median_time
from torch_fce.distributed import vocab_parallel_linear_logprobs

TRUNCATIONS = [dict(), dict(top_k=50, top_p=0.95), dict(top_p=0.95), dict(min_p=0.05),
               dict(top_k=1000)]


def _worker(rank, world, path, N, D, V, device, one_gpu):
    cuda = device == "cuda"
    gpu = 0 if one_gpu else rank
    if cuda:
        torch.cuda.set_device(gpu)
    if cuda and one_gpu:  # gloo's functional all-gather of CUDA tensors: on the host
        stage_all_gathers("cuda")
    dist.init_process_group("nccl" if cuda and not one_gpu else "gloo",
                            init_method=f"file://{path}", rank=rank, world_size=world)
    dev = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).to(dev, dtype)
    w = (torch.randn(V, D, generator=g) * 3.0 / D ** 0.5).to(dev, dtype)
    y = torch.randint(0, V, (N,), generator=g).to(dev)
    y[: N // 2] = (h[: N // 2].float() @ w.float().T).argmax(-1)  # half of them kept
    start, end = V * rank // world, V * (rank + 1) // world
    shard = w[start:end].contiguous()
    base = None
    for opts in TRUNCATIONS:
        def vp():
            return vocab_parallel_linear_logprobs(h, shard, y, vocab_start=start,
                                                  vocab_size=V, temperature=0.7, **opts)
        got = vp().logprob
        ms = median_time(vp, dev, reps=5) * 1e3
        base = base or ms
        line = f"{opts or 'untruncated'}: {ms:.2f} ms ({ms / base:.2f}x untruncated)"
        if rank == 0:
            one = lambda: torch_fce.linear_logprobs(h, w, y, temperature=0.7, **opts)
            want = one().logprob
            ms1 = median_time(one, dev, reps=5) * 1e3
            both = (got > -torch.inf) & (want > -torch.inf)
            differ = ((got > -torch.inf) != (want > -torch.inf)).sum().item()
            gap = (got - want)[both].abs().max().item() if both.any() else 0.0
            print(f"{line}; one GPU, whole head {ms1:.2f} ms; tokens kept by one only: "
                  f"{differ} of {N}; largest difference where both keep: {gap:.2e}",
                  flush=True)
    dist.destroy_process_group()


def main():
    args = sys.argv[1:]
    device = "cpu" if "--device" in args and "cpu" in args else "cuda"
    one_gpu = "--one-gpu" in args
    world = int(args[args.index("--world") + 1]) if "--world" in args else 2
    shape = [a for a in args if ":" in a]
    N, D, V = (int(x) for x in (shape[0] if shape else "16384:1536:151936").split(":"))
    if device == "cuda":
        where = f"{world} ranks on one (gloo)" if one_gpu else f"x {world} (NCCL)"
        print(f"{torch.cuda.get_device_name()} {where}, torch {torch.__version__}; "
              f"N={N} D={D} V={V}, bf16, temperature 0.7", flush=True)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), N, D, V, device, one_gpu),
                 nprocs=world, join=True)


if __name__ == "__main__":
    main()

"""python -m torch_fce.bench lowering: what the lowering pass saves in a compiled step.

Compiles one training step (forward + backward) of torch_fce.bench.tiny_lm.TinyLM, whose loss
is written the unfused way, with and without torch_fce.lowering, and prints the peak
memory of the step beyond the model and batch, its time, and the saving against the
logits copy the unfused step keeps (in the model's dtype), for each fused workspace.
"""

import argparse
import contextlib

import torch
from torch._dynamo.utils import counters

import torch_fce
import torch_fce.lowering as lowering
from torch_fce.bench.env import describe, environment
from torch_fce.bench.measure import (add_device_option, add_size_options, check_device,
                                     median_time, peak_extra_bytes)
from torch_fce.bench.tiny_lm import TinyLM


def measure(fuse, args):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(args.V, dim=args.D, layers=args.layers, heads=4, max_len=args.T)
    model.to(args.device, getattr(torch, args.dtype))
    ids = torch.randint(0, args.V, (args.B, args.T), device=args.device)
    step_fn = torch.compile(model)

    def step():
        loss = step_fn(ids, ids)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    counters.clear()
    with lowering.fresh_compiles(), lowering.auto_fuse() if fuse else contextlib.nullcontext():
        loss = step().item()  # compiles
    if fuse:
        fused = counters["inductor"][lowering.FUSED]
        print(f"  fused {fused} cross entrop{'y' if fused == 1 else 'ies'}; skipped: "
              f"{dict(counters[lowering.SKIPPED]) or 'none'}")
    mem = peak_extra_bytes(step, args.device)
    return loss, mem, median_time(step, args.device, reps=3)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_fce.bench lowering", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(p)
    add_size_options(p, V=(32768, "vocabulary size"), D=(128, "model width"),
                     layers=(2, "transformer layers"), B=(4, "sequences per batch"),
                     T=(512, "tokens per sequence"))
    p.add_argument("--dtype", default="float32", help="the model's dtype, e.g. bfloat16 (default: float32)")
    p.add_argument("--workspace-mib", default="default",
                   help="comma-separated logits workspaces for the fused step, in MiB or "
                        "'default' (torch_fce.set_workspace; default: default)")
    args = p.parse_args(argv)
    check_device(p, args.device)
    N = args.B * args.T
    print(f"# {describe(environment())}")
    copy = N * args.V * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    print(f"TinyLM V={args.V} D={args.D} layers={args.layers} {args.dtype}, batch "
          f"{args.B}x{args.T}: N*V = {N * args.V} (2^{(N * args.V).bit_length() - 1}), "
          f"logits copy {copy / 2**20:.0f} MiB")
    loss, base, sec = measure(False, args)
    print(f"{'unfused':22} loss {loss:.6f}  peak extra {base / 2**20:8.1f} MiB  step "
          f"{sec * 1e3:8.1f} ms")
    for mib in args.workspace_mib.split(","):
        with torch_fce.workspace(None if mib == "default" else int(mib) << 20):
            loss, mem, fused_sec = measure(True, args)
        print(f"{'with pass, ws ' + mib:22} loss {loss:.6f}  peak extra {mem / 2**20:8.1f} MiB"
              f"  step {fused_sec * 1e3:8.1f} ms = {fused_sec / sec:.3f}x; saved "
              f"{(base - mem) / 2**20:.1f} MiB = {(base - mem) / copy:.2f}x the logits copy "
              f"in the model's dtype", flush=True)


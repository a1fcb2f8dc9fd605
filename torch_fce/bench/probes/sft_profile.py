"""Where an SFTTrainer loss step's time goes, TRL's own against torch_fce's (bench sft's
model and batch, loss nll), and where the GPU waits for the host.

Per path: the step's median time; when the host returns from compute_loss and from
backward against when the GPU gets there (CUDA events); one profiled step's kernel time
by kind, GPU busy time and its idle gaps (with the kernels around the longest); the
step at a few workspaces; and both paths on a batch whose every token has a label.

    python torch_fce/bench/probes/sft_profile.py    # needs one CUDA GPU
"""

import argparse
import tempfile
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import torch_fce
from torch_fce.bench import sft
from torch_fce.bench.measure import median_time, peak_extra_bytes
from torch_fce.integrations import trl as fce_trl

ARGS = argparse.Namespace(device="cuda", V=151936, D=1536, layers=2, B=16, T=1024, P=64)


def _kind(name):
    low = name.lower()
    if any(k in low for k in ("gemm", "sm90", "cutlass", "nvjet")):
        return "gemm"
    if "rows_kernel" in low or low.startswith("_shard_"):  # torch_fce's Triton row kernels
        return "torch_fce rows"
    return name[:50]


def _profile(step, label):
    step()
    torch.cuda.synchronize()
    print(f"{label}: step {median_time(step, 'cuda', reps=10) * 1e3:.2f} ms (median of 10), "
          f"peak extra {peak_extra_bytes(step, 'cuda') / 2**20:.1f} MiB")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    gpu = sorted((e.time_range.start, e.time_range.end, e.name[:45]) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    kinds = {}
    for s, e, n in gpu:
        kinds[_kind(n)] = kinds.get(_kind(n), 0.0) + (e - s) / 1e3
    busy = sum(kinds.values())
    gaps = [(s1 - e0, n0, n1, e0 - gpu[0][0]) for (_, e0, n0), (s1, _, n1) in zip(gpu, gpu[1:])]
    print(f"  profiled wall {wall:.2f} ms, GPU busy {busy:.2f} ms, first kernel to last "
          f"{(gpu[-1][1] - gpu[0][0]) / 1e3:.2f} ms, {len(gpu)} kernels, gaps "
          f"{sum(g for g, *_ in gaps if g > 0) / 1e3:.2f} ms (of 20 us or more "
          f"{sum(g for g, *_ in gaps if g >= 20) / 1e3:.2f} ms)")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {v:8.3f} ms  {k}")
    for g, n0, n1, at in sorted(gaps, reverse=True)[:8]:
        print(f"    gap {g / 1e3:6.3f} ms at {at / 1e3:6.2f} ms after {n0} before {n1}")


def _timeline(trainer, batch, num_items, label):
    """When the host returns from compute_loss and backward, and when the GPU is there."""
    model = trainer.model
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    rows = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items)
        t1 = time.perf_counter()
        ev[1].record()
        loss.backward()
        t2 = time.perf_counter()
        ev[2].record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        rows.append(((t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3,
                     ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])))
    h1, h2, h3, g1, g2 = sorted(rows)[3]
    print(f"  {label} timeline: host leaves compute_loss at {h1:.2f} ms (GPU there at "
          f"{g1:.2f}), leaves backward at {h2:.2f} ms (GPU there at {g2:.2f}), synced at "
          f"{h3:.2f} ms")


def main():
    batch, num_items = sft._batch(ARGS)
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sft._save_model(ARGS, path)
        trainer = sft._trainer(ARGS, path, sft.LOSSES["nll"])
        model = trainer.model

        def step():
            loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items)
            loss.backward()
            model.zero_grad(set_to_none=True)

        def body():  # the model without its head's loss: forward and backward
            out = model.model(input_ids=batch["input_ids"],
                              attention_mask=batch["attention_mask"], use_cache=False)
            out.last_hidden_state.float().sum().backward()
            model.zero_grad(set_to_none=True)

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        _profile(body, "body alone")
        _profile(step, "trl")
        _timeline(trainer, batch, num_items, "trl")
        fce_trl.apply(trainer)
        _profile(step, "torch_fce")
        _timeline(trainer, batch, num_items, "torch_fce")
        for mib in (768, 896):  # 6 and 5 chunks of the 15360 labelled tokens
            with torch_fce.workspace(mib << 20):
                ms = median_time(step, "cuda", reps=10) * 1e3
                peak = peak_extra_bytes(step, "cuda") / 2**20
            print(f"torch_fce workspace {mib} MiB: {ms:.2f} ms, peak {peak:.1f} MiB")
        # every position labelled but each sequence's last: no token for the head to skip
        full = dict(batch, labels=batch["input_ids"].clone())
        n_full = (full["labels"][:, 1:] != -100).sum()

        def step_full():
            loss = trainer.compute_loss(model, full, num_items_in_batch=n_full)
            loss.backward()
            model.zero_grad(set_to_none=True)

        ms = median_time(step_full, "cuda", reps=10) * 1e3
        peak = peak_extra_bytes(step_full, "cuda") / 2**20
        print(f"torch_fce, every token labelled: {ms:.2f} ms, peak {peak:.1f} MiB")
        fce_trl.revert(trainer)
        print(f"trl again: {median_time(step, 'cuda', reps=10) * 1e3:.2f} ms; every token "
              f"labelled: {median_time(step_full, 'cuda', reps=10) * 1e3:.2f} ms, peak "
              f"{peak_extra_bytes(step_full, 'cuda') / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

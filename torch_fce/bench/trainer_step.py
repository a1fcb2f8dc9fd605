"""What the TRL trainer benchmarks (grpo, sft) share: their size options, and one loss
step of a trainer measured TRL's way and through torch_fce.integrations.trl.apply."""

import argparse
import warnings

from torch_fce.bench.measure import (add_device_option, add_size_options, check_device,
                                     median_time, peak_extra_bytes)
from torch_fce.integrations import trl as fce_trl


def parser(prog, doc, **sizes):
    """The benchmark's parser: --device, the llama's V, D and layers, then `sizes`
    (NAME=(default, help)), then --reps."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    add_device_option(p)
    add_size_options(p, V=(151936, "vocabulary size"), D=(1536, "hidden size"),
                     layers=(2, "decoder layers"), **sizes, reps=(5, "timed steps"))
    return p


def parse(p, argv):
    args = p.parse_args(argv)
    check_device(p, args.device)
    return args


def both_ways(trainer, compute_loss, device, reps):
    """{"trl": ..., "torch_fce": ...}, each (loss, head gradient in float32, median step
    ms, peak bytes beyond what is live) of `compute_loss(trainer).backward()`, TRL's own
    loss first, then through apply() (reverted after)."""
    model = trainer.model

    def loss_of():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's deprecation notices
            return compute_loss(trainer)

    def step():
        loss_of().backward()
        model.zero_grad(set_to_none=True)

    results = {}
    for name in ("trl", "torch_fce"):
        if name == "torch_fce":
            fce_trl.apply(trainer)
        loss = loss_of()
        loss.backward()
        head_grad = model.get_output_embeddings().weight.grad.float()
        model.zero_grad(set_to_none=True)
        mem = peak_extra_bytes(step, device)
        ms = median_time(step, device, reps=reps) * 1e3
        results[name] = (loss.item(), head_grad, ms, mem)
    fce_trl.revert(trainer)
    return results

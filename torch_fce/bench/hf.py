"""python -m torch_fce.bench transformers: a transformers training step, patched or not.

Builds a tiny random llama config with a large vocabulary, runs forward + backward of
one batch with the model's own loss and with torch_fce.integrations.transformers, and
prints each step's peak memory beyond model and batch, its time and the loss.
"""

import argparse

import torch

from torch_fce.bench.env import describe, environment
from torch_fce.integrations import transformers as fce_hf
from torch_fce.bench.measure import (add_device_option, add_size_options, check_device,
                                     median_time, peak_extra_bytes)


def main(argv=None):
    import transformers

    p = argparse.ArgumentParser(prog="python -m torch_fce.bench transformers",
                                description=__doc__)
    add_device_option(p)
    add_size_options(p, V=(64000, "vocabulary size"), D=(256, "hidden size"),
                     T=(2048, "tokens per sequence"), B=(1, "sequences per batch"))
    args = p.parse_args(argv)
    check_device(p, args.device)
    config = transformers.LlamaConfig(
        vocab_size=args.V, hidden_size=args.D, intermediate_size=2 * args.D,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.T)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(args.device).train()
    ids = torch.randint(0, args.V, (args.B, args.T), device=args.device)
    N = args.B * args.T
    print(f"# {describe(environment())}, transformers {transformers.__version__}")
    print(f"llama V={args.V} D={args.D} 2 layers, batch {args.B}x{args.T}: fp32 logits "
          f"{N * args.V * 4 / 2**20:.0f} MiB")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    results = {}
    for name in ("unpatched", "torch_fce"):
        if name == "torch_fce":
            fce_hf.apply(model)
        loss = step()
        mem = peak_extra_bytes(step, args.device)
        results[name] = mem
        print(f"{name:10} loss {loss:.6f}  peak extra {mem / 2**20:8.1f} MiB  step "
              f"{median_time(step, args.device, reps=3) * 1e3:8.1f} ms")
    saved = results["unpatched"] - results["torch_fce"]
    print(f"saved {saved / 2**20:.1f} MiB = {saved / (N * args.V * 4):.2f} x the fp32 logits")


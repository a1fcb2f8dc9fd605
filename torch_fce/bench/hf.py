"""python -m torch_fce.bench transformers: a transformers training step, patched or not.

Builds a tiny random llama config with a large vocabulary, runs forward + backward of
one batch with the model's own loss and with torch_fce.integrations.transformers, and
prints each step's peak memory beyond model and batch, its time and the loss.
"""

import argparse

import torch

from torch_fce.bench.shapes import describe, environment
from torch_fce.integrations import transformers as fce_hf
from torch_fce.bench.measure import check_device, median_time, peak_extra_bytes


def main(argv=None):
    import transformers

    p = argparse.ArgumentParser(prog="python -m torch_fce.bench transformers",
                                description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--V", type=int, default=64000, help="vocabulary size (default: 64000)")
    p.add_argument("--D", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--T", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--B", type=int, default=1, help="sequences per batch (default: 1)")
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


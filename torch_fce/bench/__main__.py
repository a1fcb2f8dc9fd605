"""python -m torch_fce.bench SUBCOMMAND [options]: one entry for the benchmark tools."""

import importlib
import sys

# subcommand -> (module, what it measures)
SUBCOMMANDS = {
    "shapes": ("shapes", "fused linear + cross-entropy (or log-probs): methods x shapes"),
    "lowering": ("lowering", "a compiled TinyLM training step with and without the pass"),
    "transformers": ("hf", "a transformers llama training step, patched and not"),
    "distributed": ("distributed", "the vocab-parallel loss on 2+ GPUs against one GPU"),
    "grpo": ("grpo", "a TRL GRPOTrainer's loss step, TRL's own and through torch_fce"),
    "sft": ("sft", "a TRL SFTTrainer's loss step (nll, dft, label smoothing), both ways"),
    "distill": ("distill", "the student-teacher divergence against TRL's, Liger's, compile"),
}


def _usage():
    lines = ["usage: python -m torch_fce.bench {%s} [options]" % "|".join(SUBCOMMANDS), "",
             "subcommands (each takes --help):"]
    lines += [f"  {name:13} {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        print(f"unknown subcommand {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"torch_fce.bench.{SUBCOMMANDS[argv[0]][0]}")
    module.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

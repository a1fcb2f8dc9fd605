"""python -m torch_fce.bench sft: a TRL SFTTrainer's loss step, TRL's own and through
torch_fce.integrations.trl.apply.

Per loss (nll, dft, label smoothing 0.1) builds a random llama-style model (bf16 on
CUDA, float32 on the CPU) in an SFTTrainer and one synthetic batch of B sequences of T
tokens whose first P are prompt (labels -100), then times
`trainer.compute_loss(model, batch, num_items_in_batch=n).backward()` with TRL's loss
(its fused head, or for label smoothing the model's full logits and LabelSmoother) and
with torch_fce's, on the same weights, and prints time, peak memory beyond the model
and batch, and how far the two losses and head gradients are apart.
"""

import gc
import tempfile
import warnings

import torch

from torch_fce.bench import trainer_step
from torch_fce.bench.env import describe, environment
from torch_fce.testing import rel_err, word_tokenizer

# name -> SFTConfig fields
LOSSES = {"nll": dict(loss_type="nll"), "dft": dict(loss_type="dft"),
          "smooth": dict(loss_type="nll", label_smoothing_factor=0.1)}


def _save_model(args, path):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.V, hidden_size=args.D, intermediate_size=2 * args.D,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.D // 128),
        max_position_embeddings=args.T)
    transformers.LlamaForCausalLM(config).to(_dtype(args)).save_pretrained(path)


def _dtype(args):
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def _trainer(args, path, fields):
    import datasets
    import transformers
    import trl

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(args))
    config = trl.SFTConfig(
        output_dir=path + "/out", **fields, per_device_train_batch_size=args.B,
        max_length=args.T, report_to=[], bf16=args.device == "cuda",
        use_cpu=args.device == "cpu", gradient_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        trainer = trl.SFTTrainer(
            model=model, args=config, processing_class=word_tokenizer(args.V),
            train_dataset=datasets.Dataset.from_dict({"text": ["w3 w4"] * args.B}))
    trainer.model.to(args.device).train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _batch(args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.V, (args.B, args.T), generator=g)
    labels = ids.clone()
    labels[:, :args.P] = -100
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    return ({k: v.to(args.device) for k, v in batch.items()},
            (labels[:, 1:] != -100).sum().to(args.device))


def main(argv=None):
    p = trainer_step.parser("python -m torch_fce.bench sft", __doc__,
                            B=(16, "sequences per batch"), T=(1024, "tokens per sequence"),
                            P=(64, "prompt tokens (no loss)"))
    p.add_argument("--losses", default=",".join(LOSSES),
                   help=f"comma-separated, of {', '.join(LOSSES)} (default: all)")
    args = trainer_step.parse(p, argv)
    losses = args.losses.split(",")
    for name in losses:
        if name not in LOSSES:
            p.error(f"--losses: unknown loss {name!r} (choose from {', '.join(LOSSES)})")
    for flag in ("V", "D", "layers", "B", "T", "reps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not 0 <= args.P < args.T - 1:
        p.error(f"--P must leave at least two of --T's {args.T} tokens, got {args.P}")
    import trl

    print(f"# {describe(environment())}, trl {trl.__version__}")
    print(f"llama V={args.V} D={args.D} {args.layers} layers, {args.B} sequences of "
          f"{args.T} tokens ({args.P} prompt), loss over num_items_in_batch")
    batch, num_items = _batch(args)
    with tempfile.TemporaryDirectory() as path:
        _save_model(args, path)
        for loss_name in losses:
            trainer = _trainer(args, path, LOSSES[loss_name])
            results = trainer_step.both_ways(
                trainer, lambda t: t.compute_loss(t.model, batch, num_items_in_batch=num_items),
                args.device, args.reps)
            (loss_t, grad_t, ms_t, mem_t) = results["trl"]
            (loss_f, grad_f, ms_f, mem_f) = results["torch_fce"]
            for name, (loss, _, ms, mem) in results.items():
                print(f"{loss_name:7} {name:10} loss {loss:.6f}  step {ms:8.2f} ms  peak extra "
                      f"{mem / 2**20:8.1f} MiB")
            print(f"{loss_name:7} torch_fce / trl time {ms_f / ms_t:.3f}, peak "
                  f"{mem_f / max(mem_t, 1):.3f}; loss difference "
                  f"{abs(loss_f - loss_t) / max(abs(loss_t), 1e-12):.2e} (relative), head "
                  f"gradient {rel_err(grad_f, grad_t):.2e}")
            del trainer, results, grad_t, grad_f
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()

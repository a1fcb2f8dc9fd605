"""python -m torch_fce.bench grpo: a TRL GRPOTrainer's loss step, TRL's own and through
torch_fce.integrations.trl.apply.

Builds a random llama-style policy (bf16 on CUDA, float32 on the CPU) with a reference
model, a GRPOTrainer (loss_type dapo, epsilon 0.2 / 0.28, beta 0.04, temperature 0.7)
and one synthetic batch of B completions of K tokens after P prompt tokens (old and
reference log-probs near the policy's, so some ratios clip), then times
`trainer.compute_loss(model, batch).backward()` with TRL's loss (its fused head) and
with torch_fce's, on the same weights, and prints time, peak memory beyond the model
and batch, and how far the two losses and head gradients are apart.
"""

import tempfile
import warnings

import torch

from torch_fce.bench import trainer_step
from torch_fce.bench.env import describe, environment
from torch_fce.bench.rl import TRL_GRPO_CONFIG
from torch_fce.testing import rel_err, word_tokenizer


def _trainer(args, path):
    import datasets
    import transformers
    import trl

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.V, hidden_size=args.D, intermediate_size=2 * args.D,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.D // 128),
        max_position_embeddings=args.P + args.K)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    config = trl.GRPOConfig(
        output_dir=path + "/out", **TRL_GRPO_CONFIG, per_device_train_batch_size=args.B,
        num_generations=args.B, max_completion_length=args.K, report_to=[],
        bf16=args.device == "cuda", use_cpu=args.device == "cpu",
        gradient_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config, train_dataset=datasets.Dataset.from_dict({"prompt": ["w3"] * args.B}),
            processing_class=word_tokenizer(args.V))
    trainer.model.to(args.device).train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _batch(trainer, args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.V, (args.B, args.P + args.K), generator=g).to(args.device)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, ones, args.K)
    noise = lambda: 0.3 * torch.randn(logps.shape, generator=g).to(logps)  # noqa: E731
    completion_mask = ones[:, args.P:]
    return dict(prompt_ids=ids[:, :args.P], prompt_mask=ones[:, :args.P],
                completion_ids=ids[:, args.P:], completion_mask=completion_mask,
                advantages=torch.randn(args.B, generator=g).to(args.device),
                old_per_token_logps=logps + noise(), ref_per_token_logps=logps + noise(),
                num_items_in_batch=completion_mask.sum())


def main(argv=None):
    p = trainer_step.parser("python -m torch_fce.bench grpo", __doc__,
                            B=(16, "completions per batch"), P=(64, "prompt tokens"),
                            K=(1024, "completion tokens"))
    args = trainer_step.parse(p, argv)
    import trl

    with tempfile.TemporaryDirectory() as path:
        trainer = _trainer(args, path)
        batch = _batch(trainer, args)
        print(f"# {describe(environment())}, trl {trl.__version__}")
        print(f"llama V={args.V} D={args.D} {args.layers} layers, {args.B} completions of "
              f"{args.K} tokens after {args.P}: dapo + k3 KL (beta 0.04), temperature 0.7")
        results = trainer_step.both_ways(trainer, lambda t: t.compute_loss(t.model, batch),
                                         args.device, args.reps)
        for name, (loss, _, ms, mem) in results.items():
            print(f"{name:10} loss {loss:.6f}  step {ms:8.2f} ms  peak extra "
                  f"{mem / 2**20:8.1f} MiB")
    (loss_t, grad_t, ms_t, _), (loss_f, grad_f, ms_f, _) = results["trl"], results["torch_fce"]
    print(f"torch_fce / trl time {ms_f / ms_t:.3f}; loss difference "
          f"{abs(loss_f - loss_t) / max(abs(loss_t), 1e-12):.2e} (relative), head gradient "
          f"{rel_err(grad_f, grad_t):.2e}")

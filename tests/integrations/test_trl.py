"""The RL recipe (docs/rl.md): per-token log-probs and entropies from the hidden states equal
TRL's own from the logits, and a GRPO clipped objective built on them gives the same
gradient for every parameter."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl_utils = pytest.importorskip("trl.trainer.utils")

from torch_fce.integrations import transformers as fce_hf  # noqa: E402
from torch_fce.integrations import trl as fce_trl  # noqa: E402
from torch_fce.testing import rel_err  # noqa: E402

pytestmark = pytest.mark.integration
# The GPU tier runs this module on CUDA (README); CI on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V, K, TEMPERATURE = 96, 7, 0.7


def _model(family="llama", device=DEVICE):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=16, final_logit_softcapping=3.0)
        return transformers.Gemma2ForCausalLM(config).double().train().to(device)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.double().train().to(device)


def _batch(device=DEVICE):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    completion_mask = torch.ones(3, K)
    completion_mask[2, 4:] = 0  # a completion that ended early
    return ids.to(device), mask.to(device), completion_mask.to(device)


def _trl_logps_and_entropies(model, ids, mask):
    """GRPOTrainer's computation from logits, with TRL's own helpers."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1]
    logps = trl_utils.selective_log_softmax(logits, ids[:, -K:], temperature=TEMPERATURE)
    return logps, trl_utils.entropy_from_logits(logits / TEMPERATURE)


def _grpo_loss(logps, old, advantages, completion_mask, eps=0.2):
    """TRL's clipped objective ("grpo" reduction: per-sequence mean, then batch mean)."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    return ((per_token * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1)).mean()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_trl_logps_entropies_and_grpo_gradients_match(family):
    ids, mask, completion_mask = _batch()
    ref_model = _model(family)
    ref_logps, ref_ent = _trl_logps_and_entropies(ref_model, ids, mask)
    model = fce_hf.apply(_model(family))
    logps, ent = fce_trl.per_token_logps_and_entropies(
        model, ids, mask, K, temperature=TEMPERATURE, compute_entropy=True)
    assert rel_err(logps, ref_logps) <= 1e-12 and rel_err(ent, ref_ent) <= 1e-12

    # old log-probs off by up to 0.3 nats, so some ratios are clipped
    old = ref_logps.detach() + 0.3 * torch.randn(
        ref_logps.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, device=DEVICE)
    for m, lp in ((ref_model, ref_logps), (model, logps)):
        _grpo_loss(lp, old, advantages, completion_mask).backward()
    for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel_err(q.grad, p.grad) <= 1e-10, name


def test_trl_needs_a_patched_model_and_a_valid_window():
    ids, mask, _ = _batch()
    with pytest.raises(ValueError, match="apply"):
        fce_trl.per_token_logps_and_entropies(_model(), ids, mask, K)
    with pytest.raises(ValueError, match="logits_to_keep"):
        fce_trl.per_token_logps_and_entropies(fce_hf.apply(_model()), ids, mask, 12)


def test_trl_grpo_trainer_hook_has_the_documented_signature():
    # docs/rl.md overrides this method; its arguments must be the ones the recipe reads.
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    params = list(inspect.signature(
        grpo.GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[:7] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep",
                          "batch_size", "compute_entropy"]


def test_trl_through_a_ddp_wrapper(tmp_path):
    # Called through the wrapper the trainer holds, so DDP's gradient hooks run
    # (one gloo process here: the call path, not the all-reduce, is what is tested).
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ids, mask, _ = _batch("cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        model = fce_hf.apply(_model(device="cpu"))
        want, _ = fce_trl.per_token_logps_and_entropies(model, ids, mask, K)
        ddp = DistributedDataParallel(model)
        logps, _ = fce_trl.per_token_logps_and_entropies(ddp, ids, mask, K)
        logps.sum().backward()
    finally:
        dist.destroy_process_group()
    assert torch.equal(logps, want)
    assert all(p.grad is not None for p in model.parameters())

"""The RL recipe (docs/rl.md): per-token log-probs and entropies from the hidden states equal
TRL's own from the logits, and a GRPO clipped objective built on them gives the same
gradient for every parameter."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
import trl.trainer.utils as trl_utils

from torch_fce.integrations import transformers as fce_hf
from torch_fce.integrations import trl as fce_trl
from torch_fce.testing import rel_err

from tests.helpers import DEVICE

# The GPU tier runs this module on CUDA (README); CI on the CPU.
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


def _transformed_logits(h, w, b, T, softcap, scale):
    """TRL's fused head's logits: softcap(scale * (h W^T + b)) / T, in float64."""
    z = F.linear(h, w, b) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / T


@pytest.mark.parametrize("softcap, outputs", [
    (None, ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")),
    (3.0, ("log_probs", "entropy", "mean_logits", "is_top1")),
    (None, ("log_probs",)),
])
def test_chunked_logprob_drop_in_equals_the_float64_composition_and_trls(softcap, outputs):
    from trl.kernels import ChunkedLogProbFunction as Theirs

    g = torch.Generator().manual_seed(5)
    N, D, Vo, T, scale = 11, 8, 37, 0.7, 1.3
    h = (torch.randn(N, D, generator=g, dtype=torch.float64) * 2).to(DEVICE).requires_grad_()
    w = torch.randn(Vo, D, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    b = torch.randn(Vo, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    y = torch.randint(0, Vo, (N,), generator=g).to(DEVICE)
    y[:4] = F.linear(h, w, b).argmax(-1)[:4]  # some targets are the most likely class
    gl, ge = (torch.randn(N, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))

    z = _transformed_logits(h, w, b, T, softcap, scale)
    logp = z.log_softmax(-1)
    want = [logp.gather(-1, y[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1),
            torch.logsumexp(2 * logp, -1), z.mean(-1), z.argmax(-1) == y]
    args = (h, w, b, y, T, 16, softcap, scale, outputs)
    for fn, tol in ((fce_trl.ChunkedLogProbFunction, 1e-12), (Theirs, 1e-5)):
        got = fn.apply(*args)
        for i, name in enumerate(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits",
                                  "is_top1")):
            if name not in outputs and name != "log_probs":
                assert got[i] is None, name
            elif name == "is_top1":
                assert torch.equal(got[i], want[i])
            else:
                assert rel_err(got[i].double(), want[i]) <= tol, (fn, name)
        upstream = (got[0] * gl).sum() + ((got[1] * ge).sum() if got[1] is not None else 0)
        grads = torch.autograd.grad(upstream, (h, w, b))
        ref = (want[0] * gl).sum() + ((want[1] * ge).sum() if "entropy" in outputs else 0)
        for a, r in zip(grads, torch.autograd.grad(ref, (h, w, b), retain_graph=True)):
            assert rel_err(a.double(), r) <= 100 * tol, fn


def test_chunked_logprob_drop_in_log_sum_sq_probs_on_confident_rows():
    # Logits about 50 +- 20 in float32, most rows p(max) > 0.98: log sum_v p_v^2 is small
    # there, and two separately rounded logsumexps (3.9e-3 relative error) would swamp it.
    # Formed relative to the row max, as TRL's kernel does: within twice its error.
    from tests.helpers import confident_inputs
    from trl.kernels import ChunkedLogProbFunction as Theirs

    h, w, y = (t.to(DEVICE) for t in confident_inputs(48, 24, 257, offset=50.0))
    truth = torch.logsumexp(2 * F.linear(h.double(), w.double()).log_softmax(-1), -1)
    args = (h, w, None, y, 1.0, 64, None, 1.0, ("log_probs", "log_sum_sq_probs"))
    ours, theirs = (rel_err(fn.apply(*args)[2].double(), truth)
                    for fn in (fce_trl.ChunkedLogProbFunction, Theirs))
    assert ours <= 2 * theirs + 1e-7, (ours, theirs)


def test_chunked_logprob_drop_in_refuses_what_it_cannot_serve():
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="outputs"):
        fce_trl.ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 8, None, 1.0, ("logits",))
    zero3 = torch.randn(5, 4)
    zero3.ds_id = 7  # how DeepSpeed ZeRO-3 marks its parameters
    with pytest.raises(ValueError, match="ZeRO-3"):
        fce_trl.ChunkedLogProbFunction.apply(h, zero3, None, y, 1.0, 8)


def test_chunked_logprob_drop_in_under_autocast_keeps_float32_statistics():
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(6, 8, generator=g), torch.randn(33, 8, generator=g)
    y = torch.randint(0, 33, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fce_trl.ChunkedLogProbFunction.apply(h, w, None, y, 0.7, 16, None, 1.0,
                                                   ("entropy", "mean_logits"))
    want = (F.linear(h.bfloat16().double(), w.double()) / 0.7).mean(-1)
    assert out[3].dtype == torch.float32 and rel_err(out[3], want) <= 1e-5


def test_fused_lm_head_context_serves_trls_head_and_puts_it_back():
    # A model with TRL's fused head: inside the context its log-probs are torch_fce's
    # (float64-exact, where TRL's kernel keeps float32 statistics), and TRL's afterwards.
    import trl.trainer.utils as trl_utils

    ids, mask, _ = _batch()
    model = _model("gemma2")
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1] / TEMPERATURE
        want = trl_utils.selective_log_softmax(logits, ids[:, 1:])
    trl_utils.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    theirs = trl_utils._ChunkedLogProbFunction
    with fce_trl.fused_lm_head():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
    assert trl_utils._ChunkedLogProbFunction is theirs
    assert rel_err(out.log_probs, want) <= 1e-12
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    theirs_out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert 1e-12 < rel_err(theirs_out.log_probs, want) <= 1e-5


def test_fused_lm_head_serves_mean_logits_of_a_softcapped_family():
    # KTO asks for mean_logits; a softcapped family's mean takes a sweep of the logits.
    import trl.trainer.utils as trl_utils

    ids, mask, _ = _batch()
    model = _model("gemma2")
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask).logits.double() / TEMPERATURE
    trl_utils.add_fused_lm_head(model, temperature=TEMPERATURE,
                                outputs=("log_probs", "mean_logits"))
    labels = ids.masked_fill(mask == 0, -100)
    with fce_trl.fused_lm_head(), warnings.catch_warnings():
        warnings.simplefilter("error")  # served: no fallback warning
        got = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert rel_err(got.mean_logits.double(), z[:, :-1].mean(-1)) <= 1e-6

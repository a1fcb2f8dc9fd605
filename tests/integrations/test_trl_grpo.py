"""torch_fce.integrations.trl.apply(trainer): a real TRL GRPOTrainer (tiny float64 llama)
computes the same loss, parameter gradients and logged metrics as TRL's own
_compute_loss, per loss_type and option. TRL's reference runs its own loss code on
exact float64 log-probs from the logits (its fused head sums in float32, which would
hide a wrong weighting below its rounding)."""

import types
import warnings

import datasets
import pytest
import torch
import transformers
import trl
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from torch_fce.integrations import trl as fce_trl
from torch_fce.testing import rel_err, word_tokenizer

from tests.helpers import DEVICE
from tests.references import sampler_kept

V, P, K, B = 96, 3, 7, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).double().save_pretrained(path)
    return path


def _trainer(model_dir, tmp_path, **config):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=B,
                    num_generations=B, max_completion_length=K, report_to=[],
                    use_cpu=DEVICE == "cpu", bf16=False, temperature=0.7, logging_steps=1,
                    max_steps=1)
    args = trl.GRPOConfig(**{**defaults, **config})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["w3 w4 w5"] * B}),
            processing_class=word_tokenizer(V))


def _exact_logps(trainer):
    """TRL's _get_per_token_logps_and_entropies, from the model's float64 logits."""
    def get(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
            compute_entropy=False, compute_aux_loss=False, **kwargs):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1:-1] / trainer.temperature
        logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
        return logps, entropy_from_logits(logits) if compute_entropy else None, None
    return get


def _inputs(trainer, on_policy=False, vllm=False, tool_mask=False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (B, P + K), generator=g)
    completion_mask = torch.ones(B, K, dtype=torch.int64)
    completion_mask[1, 4:] = 0  # a completion that ended early
    completion_mask[3, 2:] = 0
    inputs = dict(prompt_ids=ids[:, :P], prompt_mask=torch.ones(B, P, dtype=torch.int64),
                  completion_ids=ids[:, P:], completion_mask=completion_mask,
                  advantages=torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64),
                  num_items_in_batch=completion_mask.sum() * 2)
    with torch.no_grad():  # on the model's device, then as the rest, on the CPU
        dev = ids.to(trainer.model.device)
        logps = _exact_logps(trainer)(trainer.model, dev, torch.ones_like(dev), K)[0]
        logps = logps.double().cpu()
    if not on_policy:  # off by up to 0.4 nats: some ratios clip on either side
        inputs["old_per_token_logps"] = logps + 0.4 * torch.randn(logps.shape, generator=g,
                                                                   dtype=torch.float64)
    inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g,
                                                               dtype=torch.float64)
    if vllm:
        inputs["importance_sampling_ratio"] = torch.rand(B, K, generator=g,
                                                         dtype=torch.float64) * 1.5
    if tool_mask:
        inputs["tool_mask"] = torch.ones(B, K, dtype=torch.int64)
        inputs["tool_mask"][0, 1:3] = 0
    return {k: v.to(DEVICE) for k, v in inputs.items()}


CASES = {
    "grpo beta": dict(loss_type="grpo", beta=0.04),  # the KL's bias correction: default on
    "grpo beta uncorrected": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    "dapo": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
    "dapo entropy bonus": dict(loss_type="dapo", epsilon_high=0.28, entropy_coef=0.05),
    "dr_grpo delta vllm": dict(loss_type="dr_grpo", delta=1.3, beta=0.02),
    "bnpo beta entropy": dict(loss_type="bnpo", beta=0.04, entropy_coef=0.03),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "sapo tool mask": dict(loss_type="sapo", beta=0.01),
    "grpo on-policy entropy": dict(loss_type="grpo", entropy_coef=0.02),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", CASES)
def test_grpo_trainer_loss_gradients_and_metrics_equal_trls(model_dir, tmp_path, case, mode):
    config = CASES[case]
    results = []
    for fused in (False, True):
        trainer = _trainer(model_dir, tmp_path, **config)
        trainer.model.train(mode == "train")
        trainer.current_gradient_accumulation_steps = 2
        if "vllm" in case:  # set on the instance: vLLM is not installed here
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        if fused:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # served: no warning
                fce_trl.apply(trainer)
        else:
            trainer._get_per_token_logps_and_entropies = _exact_logps(trainer)
        trainer.model.to(DEVICE)
        inputs = _inputs(trainer, on_policy="on-policy" in case, vllm="vllm" in case,
                         tool_mask="tool mask" in case)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters()}
        metrics = {k: v[-1] for k, v in trainer._metrics[mode].items()}
        results.append((loss.detach(), grads, metrics))
    (want, want_grads, want_metrics), (got, got_grads, got_metrics) = results
    # TRL forms sapo's temperatures as float32 tensors (torch.where on Python floats)
    tol = 1e-6 if config["loss_type"] == "sapo" else 1e-10
    assert abs(float(got) - float(want)) <= tol * max(1.0, abs(float(want)))
    for name, g in want_grads.items():
        assert (g is None) == (got_grads[name] is None), name
        if g is not None:
            assert rel_err(got_grads[name], g) <= tol, name
    assert set(got_metrics) == set(want_metrics)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=tol, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("config, reason", [
    (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(loss_type="vespo"), "loss_type='vespo'"),
    (dict(loss_type="luspo"), "loss_type='luspo'"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    (dict(loss_type="dapo", beta=0.04, entropy_coef=0.01), "entropy bonus with a KL"),
    (dict(cast_lm_head_to_fp32=True), "forward was replaced"),
])
def test_grpo_trainer_unsupported_keeps_trls_loss_with_one_warning(model_dir, tmp_path, config,
                                                                  reason):
    trainer = _trainer(model_dir, tmp_path, **config)
    head = trainer.model.get_output_embeddings()
    head_forward = vars(head).get("forward")
    with pytest.warns(UserWarning, match=reason) as record:
        assert fce_trl.apply(trainer) is trainer
    assert len([w for w in record if "torch_fce" in str(w.message)]) == 1
    assert "_compute_loss" not in vars(trainer)
    assert vars(head).get("forward") is head_forward  # the model untouched
    with pytest.raises(ValueError, match="not applied"):
        fce_trl.revert(trainer)


def test_grpo_trainer_float16_keeps_trls_loss(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, loss_type="dapo")
    trainer.model.half()
    with pytest.warns(UserWarning, match="float16"):
        fce_trl.apply(trainer)
    assert "_compute_loss" not in vars(trainer)


def test_grpo_trainer_other_trl_release_keeps_trls_loss(model_dir, tmp_path, monkeypatch):
    trainer = _trainer(model_dir, tmp_path, loss_type="dapo")
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(UserWarning, match="TRL 1.17.0 is installed"):
        fce_trl.apply(trainer)
    assert "_compute_loss" not in vars(trainer)


def test_grpo_trainer_revert_and_bad_input(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, loss_type="dapo")
    head = trainer.model.get_output_embeddings()
    with pytest.raises(ValueError, match="accumulator"):
        fce_trl.apply(trainer, accumulator="fp16")
    fce_trl.apply(trainer)
    with pytest.raises(ValueError, match="already applied"):
        fce_trl.apply(trainer)
    assert "forward" in vars(head)  # the capture
    fce_trl.revert(trainer)
    assert "_compute_loss" not in vars(trainer) and "forward" not in vars(head)
    with pytest.warns(UserWarning, match="GRPOTrainer"):
        fce_trl.apply(types.SimpleNamespace())


def test_grpo_trainer_trains_a_step_through_torch_fce(model_dir, tmp_path):
    # The whole loop: generation, rewards, old log-probs through TRL's head, the loss
    # through torch_fce, the optimizer step, the logged metrics.
    trainer = _trainer(model_dir, tmp_path, loss_type="dapo", beta=0.04,
                       gradient_accumulation_steps=2, per_device_train_batch_size=2,
                       num_generations=4, steps_per_generation=2, num_iterations=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    calls = []
    fce_trl.apply(trainer)
    ours = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: calls.append(1) or ours(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.train()
    assert calls and torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    logged = trainer.state.log_history[0]
    assert {"kl", "entropy", "clip_ratio/region_mean"} <= set(logged)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a bf16 policy on a CUDA GPU")
def test_grpo_trainer_bf16_on_cuda_agrees_with_trls_fused_head(model_dir, tmp_path):
    # The regime users run: a bf16 policy with bf16 autocast on the GPU, against TRL's
    # own loss through its own fused head. Both round the logits differently (TRL's tiles
    # are bf16), so the bar is bf16's, which a wrong weighting (a factor 2, a missing
    # mask) would still exceed many times over.
    results = []
    for fused in (False, True):
        trainer = _trainer(model_dir, tmp_path, loss_type="dapo", beta=0.04, bf16=True,
                           use_cpu=False)
        trainer.model.to(DEVICE, torch.bfloat16)
        trainer.current_gradient_accumulation_steps = 1
        if fused:
            fce_trl.apply(trainer)
        inputs = _inputs(trainer)
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach().item(), {n: p.grad.float() for n, p in
                                      trainer.model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert abs(got - want) <= 2e-2 * max(abs(want), 1e-2)
    for name, g in want_grads.items():
        assert rel_err(got_grads[name], g) <= 5e-2, name


class _VLLMStandIn:
    """vLLM's generation offline: each prompt's completion sampled from the float64
    model with vLLM's rules (tests/references.sampler_kept) at the trainer's temperature,
    and the processed log-probs vLLM returns with --logprobs-mode processed_logprobs."""

    def __init__(self, trainer, truncation):
        self.trainer, self.truncation = trainer, truncation

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        g = torch.Generator().manual_seed(11)
        model = self.trainer.model
        completions, logprobs = [], []
        for prompt in prompts:
            ids, lps = list(prompt), []
            for _ in range(K):
                with torch.no_grad():
                    z = model(torch.tensor([ids], device=model.device)).logits[0, -1].cpu()
                z = z.double() / self.trainer.temperature
                keep = sampler_kept(z[None], **self.truncation)[0]
                logq = torch.where(keep, z, float("-inf")).log_softmax(-1)
                token = int(torch.multinomial(logq.exp(), 1, generator=g))
                ids.append(token)
                lps.append([float(logq[token])])
            completions.append(ids[len(prompt):])
            logprobs.append(lps)
        return None, completions, logprobs, None


@pytest.mark.parametrize("truncation, mode", [
    (dict(top_k=5, top_p=0.9), "token_truncate"), (dict(min_p=0.9, top_p=0.5), "sequence_mask")])
def test_grpo_match_sampler_gives_the_importance_weight_the_samplers_logprobs(
        model_dir, tmp_path, truncation, mode):
    # A generation step of a real GRPOTrainer with vLLM's correction, its samples drawn as
    # vLLM draws them under top_k / top_p / min_p: with match_sampler the weight
    # exp(old - sampling) is 1 at every completion token (the trainer side now of the
    # same truncated distribution), TRL's own is biased below 1; the PPO ratio's old
    # log-probs stay the untruncated ones (the float64 composition from the logits).
    outputs = {}
    for match in (False, True):
        trainer = _trainer(model_dir, tmp_path, vllm_importance_sampling_mode=mode,
                           **{"top_k": 0, "top_p": 1.0, **truncation})
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer.vllm_generation = _VLLMStandIn(trainer, truncation)
        trainer._last_loaded_step = trainer.state.global_step
        if not match:  # TRL's pass on exact float64 log-probs
            trainer._get_per_token_logps_and_entropies = _exact_logps(trainer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served: no warning
            fce_trl.apply(trainer, match_sampler=match)
        trainer.model.to(DEVICE)
        outputs[match] = trainer._generate_and_score_completions(
            [{"prompt": "w3 w4 w5"}] * B)
        if match:
            fce_trl.revert(trainer)
            assert "_generate_and_score_completions" not in vars(trainer)
            assert "_get_per_token_logps_and_entropies" not in vars(trainer)
    ours, theirs = outputs[True], outputs[False]
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    m = ours["completion_mask"].bool()
    assert m.sum() >= 8
    def weights(out):  # per token, or per sequence (B, 1)
        ratio = out["importance_sampling_ratio"]
        return ratio[m] if ratio.shape == m.shape else ratio

    # TRL builds the sampling log-probs as a float32 tensor: 1 to float32's rounding
    assert (weights(ours) - 1.0).abs().max() <= 1e-6
    assert (weights(theirs) < 1.0 - 1e-3).any()
    assert rel_err(ours["old_per_token_logps"][m], theirs["old_per_token_logps"][m]) <= 1e-12


def test_grpo_match_sampler_refusals_warn_and_keep_trls_weight(model_dir, tmp_path):
    for config, setup, reason in (
            (dict(top_p=0.9), lambda t: None, "no vLLM importance-sampling correction"),
            (dict(), lambda t: setattr(t, "use_vllm", True), "truncates nothing"),
            (dict(top_p=0.9, repetition_penalty=1.1), lambda t: setattr(t, "use_vllm", True),
             "repetition_penalty")):
        trainer = _trainer(model_dir, tmp_path, **config)
        setup(trainer)
        with pytest.warns(UserWarning, match=reason):
            fce_trl.apply(trainer, match_sampler=True)
        assert "_generate_and_score_completions" not in vars(trainer)
        assert "_compute_loss" in vars(trainer)  # the loss is still served

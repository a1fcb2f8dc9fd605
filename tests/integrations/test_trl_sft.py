"""torch_fce.integrations.trl.apply(trainer) on a real TRL SFTTrainer (tiny float64
llama and mixtral): the same loss, parameter gradients and logged metrics as TRL's own
compute_loss, per loss_type and option, in train and eval. TRL's reference runs its own
loss code with an exact float64 fused head (its kernel sums in float32, which would hide
a wrong weighting below its rounding)."""

import types
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers
import trl
import trl.trainer.utils as trl_utils

from torch_fce.integrations import trl as fce_trl
from torch_fce.testing import rel_err, word_tokenizer

from tests.helpers import DEVICE

V, B, T = 96, 3, 9


def _save(path, config, cls):
    torch.manual_seed(0)
    model = cls(config).double()
    with torch.no_grad():  # peaked distributions: accuracy and entropy away from chance
        model.get_output_embeddings().weight.mul_(40.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": _save(tmp_path_factory.mktemp("llama"), transformers.LlamaConfig(**common),
                       transformers.LlamaForCausalLM),
        "mixtral": _save(tmp_path_factory.mktemp("mixtral"), transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
            output_router_logits=True), transformers.MixtralForCausalLM),
    }


def _trainer(path, tmp_path, trainer_cls=None, **config):
    # eager experts: the grouped-GEMM ones take no float64
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager")
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=B,
                    report_to=[], use_cpu=DEVICE == "cpu", bf16=False, logging_steps=1,
                    max_steps=1, max_length=T)
    args = trl.SFTConfig(**{**defaults, **config})
    data = datasets.Dataset.from_dict({"text": [" ".join(f"w{3 + (5 * i + j) % (V - 3)}"
                                                         for j in range(T)) for i in range(8)]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        return (trainer_cls or trl.SFTTrainer)(model=model, args=args, train_dataset=data,
                                               processing_class=word_tokenizer(V))


class _ExactHead:
    """trl.kernels.ChunkedLogProbFunction's apply, from float64 logits."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None,
              logit_scale=1.0, outputs=("log_probs",)):
        z = F.linear(hidden.double(), weight.double(),
                     None if bias is None else bias.double()) * logit_scale / temperature
        logp = z.log_softmax(-1)
        lp = logp.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return lp, entropy, None, None, top1


def _batch(model, padding_free=False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    with torch.no_grad():  # every other label the model's own guess: accuracy near 1/2
        guess = model(input_ids=ids.to(model.device)).logits.argmax(-1).cpu()
    labels[:, 1::2] = guess[:, :-1:2]
    labels[:, :3] = -100  # prompts (completion-only loss)
    labels[1, 6:] = -100  # padding
    attention = torch.ones(B, T, dtype=torch.int64)
    attention[1, 6:] = 0
    ids[1, 6:] = 1
    labels[2, 4] = -100  # a masked assistant token
    if padding_free:  # the rows packed into one, position_ids restarting per sequence
        keep = attention.bool()
        labels = torch.where(torch.arange(T) == 0, -100, labels)  # no pairs across rows
        batch = dict(input_ids=ids[keep][None], labels=labels[keep][None],
                     position_ids=torch.cat([torch.arange(int(n)) for n in
                                             attention.sum(1)])[None])
    else:
        batch = dict(input_ids=ids, attention_mask=attention, labels=labels)
    return {k: v.to(DEVICE) for k, v in batch.items()}


CASES = {
    "nll": dict(),
    "nll num_items": dict(num_items=11),
    "dft": dict(loss_type="dft"),
    "dft num_items": dict(loss_type="dft", num_items=11),
    "label smoothing": dict(label_smoothing_factor=0.1),
    "label smoothing num_items": dict(label_smoothing_factor=0.2, num_items=11),
    "dft ignores label smoothing": dict(loss_type="dft", label_smoothing_factor=0.1),
    "padding-free": dict(padding_free=True, max_length=None),
    "moe aux": dict(model="mixtral"),
    "moe aux num_items": dict(model="mixtral", num_items=11),
    "moe aux label smoothing": dict(model="mixtral", label_smoothing_factor=0.1),
}


def _run(model_dirs, tmp_path, config, mode, fused, monkeypatch):
    config = dict(config)
    path = model_dirs[config.pop("model", "llama")]
    num_items, padding_free = config.pop("num_items", None), config.get("padding_free", False)
    trainer = _trainer(path, tmp_path, **config)
    trainer.model.train(mode == "train")
    trainer.current_gradient_accumulation_steps = 2
    if fused:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served: no warning
            fce_trl.apply(trainer)
    else:
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", _ExactHead)
    trainer.model.to(DEVICE)
    inputs = _batch(trainer.model, padding_free)
    given = {k: v.clone() for k, v in inputs.items()}
    n = None if num_items is None else torch.tensor(num_items, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=n)
    loss.backward()
    if fused:  # the caller's batch untouched (TRL's own adds use_cache to it)
        assert inputs.keys() == given.keys()
        assert all(torch.equal(inputs[k], given[k]) for k in given)
    monkeypatch.undo()
    grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", CASES)
def test_sft_trainer_loss_gradients_and_metrics_equal_trls(model_dirs, tmp_path, case, mode,
                                                           monkeypatch):
    want, want_grads, want_metrics = _run(model_dirs, tmp_path, CASES[case], mode, False,
                                          monkeypatch)
    got, got_grads, got_metrics = _run(model_dirs, tmp_path, CASES[case], mode, True,
                                       monkeypatch)
    # LabelSmoother sums -log p over the classes in float32 (whatever the logits' dtype)
    tol = 1e-7 if "label smoothing" in case and "dft" not in case else 1e-10
    assert abs(float(got) - float(want)) <= tol * max(1.0, abs(float(want)))
    for name, g in want_grads.items():
        assert (g is None) == (got_grads[name] is None), name
        if g is not None:
            assert rel_err(got_grads[name], g) <= tol, name
    assert set(got_metrics) == set(want_metrics)
    assert {"entropy", "mean_token_accuracy"} <= set(want_metrics)
    assert "moe" not in case or "aux_loss" in want_metrics
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert 0.0 < want_metrics["mean_token_accuracy"] < 1.0  # the metric can fail


def test_sft_trainer_head_sees_only_labelled_tokens(model_dirs, tmp_path, monkeypatch):
    # prompts, padding and each sequence's last position cost the head nothing; its
    # chunks are bounded as TRL's head's memory
    trainer = _trainer(model_dirs["llama"], tmp_path)
    fce_trl.apply(trainer)
    trainer.model.to(DEVICE)
    inputs = _batch(trainer.model)
    from torch_fce.integrations.trl import sft

    rows, op = [], sft.linear_cross_entropy
    monkeypatch.setattr(sft, "linear_cross_entropy", lambda h, w, y, *a, **k:
                        rows.append((h.shape[0], y, k.get("head_bound"))) or op(h, w, y, *a, **k))
    trainer.compute_loss(trainer.model, inputs)
    labels = inputs["labels"][:, 1:]
    (n, y, bounded), = rows
    assert n == int((labels != -100).sum()) < labels.numel()
    assert bounded is True  # the workspace of the head it replaces, TRL's
    assert torch.equal(y, labels[labels != -100])  # in the batch's order


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_sft_trainer_batch_without_labelled_tokens_equals_trls(model_dirs, tmp_path, mode,
                                                                monkeypatch):
    def run(fused):
        trainer = _trainer(model_dirs["llama"], tmp_path)
        trainer.model.train(mode == "train")
        if fused:
            fce_trl.apply(trainer)
        else:
            monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", _ExactHead)
        trainer.model.to(DEVICE)
        inputs = _batch(trainer.model)
        inputs["labels"] = torch.full_like(inputs["labels"], -100)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        monkeypatch.undo()
        return (loss.detach(), {n: p.grad for n, p in trainer.model.named_parameters()},
                {k: v[-1] for k, v in trainer._metrics[mode].items()})

    (want, want_grads, want_metrics), (got, got_grads, got_metrics) = run(False), run(True)
    assert float(got) == float(want) == 0.0
    for name, g in want_grads.items():
        assert (g is None) == (got_grads[name] is None), name
        if g is not None:
            assert torch.equal(got_grads[name], g), name
    assert got_metrics == want_metrics


def test_sft_trainer_trains_a_step_through_torch_fce_and_reverts(model_dirs, tmp_path):
    trainer = _trainer(model_dirs["llama"], tmp_path, gradient_accumulation_steps=2,
                       per_device_train_batch_size=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    head = trainer.model.get_output_embeddings()
    fce_trl.apply(trainer)
    with pytest.raises(ValueError, match="already applied"):
        fce_trl.apply(trainer)
    calls = []
    ours = trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: calls.append(1) or ours(*a, **k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.train()
    assert calls and torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(trainer.state.log_history[0])
    del trainer.compute_loss  # the counting wrapper, then ours
    trainer.compute_loss = ours
    fce_trl.revert(trainer)
    assert "compute_loss" not in vars(trainer) and "forward" not in vars(head)
    assert not hasattr(trainer, "_torch_fce_loss")


def test_sft_trainer_revert_gives_trls_path_back_bit_for_bit(model_dirs, tmp_path):
    trainer = _trainer(model_dirs["llama"], tmp_path)
    trainer.model.to(DEVICE)
    inputs = _batch(trainer.model)

    def step():
        trainer.model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]

    want = step()
    fce_trl.apply(trainer)
    step()
    fce_trl.revert(trainer)
    got = step()
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_sft_trainer_return_outputs_runs_trls_loss_with_a_warning(model_dirs, tmp_path):
    trainer = _trainer(model_dirs["llama"], tmp_path)
    fce_trl.apply(trainer)
    trainer.model.to(DEVICE)
    # ours, and TRL's own deprecation of return_outputs=True, as TRL's loss raises it
    with pytest.warns(UserWarning, match="return_outputs=True"), \
            pytest.warns(FutureWarning, match="return_outputs=True.*deprecated"):
        loss, outputs = trainer.compute_loss(trainer.model, _batch(trainer.model),
                                             return_outputs=True)
    assert outputs.logits.shape[-1] == V and loss.isfinite()


class _Overriding(trl.SFTTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("make, reason", [
    (lambda d, p: _trainer(d, p, trainer_cls=_Overriding), "overrides compute_loss"),
    (lambda d, p: _with_loss_func(_trainer(d, p)), "compute_loss_func"),
    (lambda d, p: _with_tp(_trainer(d, p)), "tensor parallelism"),
])
def test_sft_trainer_unsupported_keeps_trls_loss_with_one_warning(model_dirs, tmp_path, make,
                                                                 reason):
    trainer = make(model_dirs["llama"], tmp_path)
    head = trainer.model.get_output_embeddings()
    with pytest.warns(UserWarning, match=reason) as record:
        assert fce_trl.apply(trainer) is trainer
    assert len([w for w in record if "torch_fce" in str(w.message)]) == 1
    assert "compute_loss" not in vars(trainer) and "forward" not in vars(head)
    with pytest.raises(ValueError, match="not applied"):
        fce_trl.revert(trainer)
    with pytest.warns(UserWarning, match="SFTTrainer"):
        fce_trl.apply(types.SimpleNamespace())


def _with_loss_func(trainer):
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: None
    return trainer


def _with_tp(trainer):
    trainer.get_tp_size = lambda: 2
    return trainer

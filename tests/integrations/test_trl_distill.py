"""torch_fce.integrations.trl on TRL 1.16's distillation: apply(trainer) on a real
DistillationTrainer (tiny float64 llama student and a wider teacher) gives TRL's loss,
every student gradient and the entropy metric, per beta, in train and eval; a training
step runs; refusals warn and keep TRL's; revert gives TRL's path back. TRL's reference
runs its own loss code with an exact float64 divergence from explicit logits (its
kernel's buffers are float32, which would hide a wrong weighting below their rounding).
The drop-ins (ChunkedDivergenceFunction, chunked_divergence_loss) against TRL's own."""

import math
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers
import trl
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
from trl.trainer import distillation_trainer as trl_distill

from torch_fce.integrations import trl as fce_trl
from torch_fce.testing import rel_err, word_tokenizer

from tests.helpers import DEVICE, trainer_loss_step

V, B, P, K = 96, 3, 4, 6


def _logits(h, w, b, scale, softcap, T):
    z = F.linear(h.double(), w.double(), None if b is None else b.double()) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / T


class _ExactDivergence:
    """trl.kernels.ChunkedDivergenceFunction's apply from float64 logits (its formulas)."""

    @staticmethod
    def apply(hs, ws, bs, ht, wt, bt, beta, T=1.0, s_scale=1.0, s_cap=None, t_scale=1.0,
              t_cap=None):
        lq = _logits(hs, ws, bs, s_scale, s_cap, T).log_softmax(-1)
        with torch.no_grad():
            lp = _logits(ht, wt, bt, t_scale, t_cap, T).log_softmax(-1)
        if beta == 0.0:
            div = (lp.exp() * (lp - lq)).sum(-1)
        elif beta == 1.0:
            div = (lq.exp() * (lq - lp)).sum(-1)
        else:
            lm = torch.logsumexp(torch.stack([lq + math.log(1 - beta), lp + math.log(beta)]),
                                 0)
            div = beta * (lp.exp() * (lp - lm)).sum(-1) + \
                (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
        return div, -(lq.exp() * lq).sum(-1).detach()


def _model(hidden, seed, **extra):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, **extra)
    model = transformers.LlamaForCausalLM(config).double().to(DEVICE)
    with torch.no_grad():  # peaked distributions, as trained heads have
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _trainer(tmp_path, cls=None, student=None, teacher=None, **config):
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                    max_completion_length=4, max_steps=1, report_to=[],
                    use_cpu=DEVICE == "cpu", bf16=False, gradient_checkpointing=False,
                    logging_steps=1)
    args = trl.DistillationConfig(**{**defaults, **config})
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7"] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        return (cls or trl.DistillationTrainer)(
            model=student or _model(32, 0), teacher_model=teacher or _model(48, 1),
            args=args, train_dataset=data, processing_class=word_tokenizer(V))


def _batch(tool_mask=False):
    g = torch.Generator().manual_seed(4)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g),
                 prompt_mask=torch.ones(B, P, dtype=torch.long),
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=torch.ones(B, K, dtype=torch.long))
    batch["prompt_mask"][0, 0] = 0  # left padding
    batch["completion_mask"][1, 3:] = 0  # right padding after an EOS
    if tool_mask:
        batch["tool_mask"] = torch.ones(B, K, dtype=torch.long)
        batch["tool_mask"][2, 1:3] = 0
    n = (batch["completion_mask"] * batch.get("tool_mask", 1)).sum()
    batch["num_items_in_batch"] = n.double() * 1.5  # as if from more micro-batches
    return {k: v.to(DEVICE) for k, v in batch.items()}


def _step(trainer, batch, mode):
    return (*trainer_loss_step(trainer, batch, mode),
            trainer._metrics[mode]["entropy"][-1])


def _trl_exact(trainer, batch, mode, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(trl_distill, "ChunkedDivergenceFunction", _ExactDivergence)
        return _step(trainer, batch, mode)


@pytest.mark.parametrize("beta, temperature, mode, tool_mask", [
    (0.0, 1.0, "train", False), (0.5, 0.7, "train", True), (1.0, 2.0, "train", False),
    (0.3, 1.0, "eval", True)])
def test_apply_gives_trls_loss_gradients_and_entropy(tmp_path, monkeypatch, beta, temperature,
                                                      mode, tool_mask):
    trainer = _trainer(tmp_path, beta=beta, temperature=temperature)
    batch = _batch(tool_mask)
    want = _trl_exact(trainer, batch, mode, monkeypatch)
    fce_trl.apply(trainer)
    got = _step(trainer, batch, mode)
    assert abs(got[0].item() - want[0].item()) <= 1e-10 * abs(want[0].item())
    assert want[1].keys() == got[1].keys() and len(got[1]) > 0
    for name, g in want[1].items():
        assert rel_err(got[1][name], g) <= 1e-9, name
    assert abs(got[2] - want[2]) <= 1e-10 * abs(want[2])
    fce_trl.revert(trainer)
    assert "_compute_loss" not in vars(trainer)
    back = _trl_exact(trainer, batch, mode, monkeypatch)
    assert torch.equal(back[0], want[0])


def test_apply_serves_logit_scales_softcaps_and_head_biases(tmp_path, monkeypatch):
    student = _model(32, 0, final_logit_softcapping=6.0, logit_scale=0.7)
    teacher = _model(48, 1, final_logit_softcapping=9.0)
    for m, seed in ((student, 5), (teacher, 6)):  # heads with a bias
        head = m.get_output_embeddings()
        head.bias = torch.nn.Parameter(torch.randn(V, generator=torch.Generator().manual_seed(
            seed), dtype=torch.float64).to(DEVICE))
    trainer = _trainer(tmp_path, student=student, teacher=teacher, beta=0.5)
    batch = _batch()
    want = _trl_exact(trainer, batch, "train", monkeypatch)
    fce_trl.apply(trainer)
    got = _step(trainer, batch, "train")
    assert abs(got[0].item() - want[0].item()) <= 1e-10 * abs(want[0].item())
    assert "lm_head.bias" in got[1]
    for name, g in want[1].items():
        assert rel_err(got[1][name], g) <= 1e-9, name


def test_a_training_step_runs_and_revert_restores(tmp_path):
    trainer = _trainer(tmp_path, beta=0.5)
    before = dict(vars(trainer))
    fce_trl.revert(fce_trl.apply(trainer))
    assert vars(trainer) == before
    fce_trl.apply(trainer)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    assert "entropy" in trainer.state.log_history[0]
    fce_trl.revert(trainer)
    assert "_compute_loss" not in vars(trainer)
    assert trl_distill._chunked_divergence_loss.__module__ == trl_distill.__name__


def test_refusals_warn_once_and_keep_trls_loss(tmp_path):
    class Custom(trl.DistillationTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    trainer = _trainer(tmp_path, cls=Custom)
    with pytest.warns(UserWarning, match="overrides compute_loss") as seen:
        fce_trl.apply(trainer)
    assert len(seen) == 1 and "_compute_loss" not in vars(trainer)


def test_a_zero_logit_scale_runs_trls_divergence(monkeypatch):
    # TRL keeps a configured logit_scale of 0 (a uniform student); the op takes > 0
    g = torch.Generator().manual_seed(0)
    hs, ws = torch.randn(2, 3, 5, generator=g), torch.randn(V, 5, generator=g)
    ht, wt = torch.randn(2, 3, 7, generator=g), torch.randn(V, 7, generator=g)
    mask = torch.ones(2, 3)
    called = []
    with pytest.warns(UserWarning, match="student_logit_scale=0.0"):
        fce_trl.chunked_divergence_loss(hs, ht, ws, wt, mask, 0.5, student_logit_scale=0.0,
                                        fallback=lambda *a: called.append(a) or (0, 0, 0))
    assert len(called) == 1
    with pytest.raises(ValueError, match="teacher_logit_scale"):
        fce_trl.chunked_divergence_loss(hs, ht, ws, wt, mask, 0.5, teacher_logit_scale=0.0)


def _heads(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    N, Ds, Dt = 11, 6, 9

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    return (r(N, Ds), r(V, Ds, scale=2.0), r(V), r(N, Dt), r(V, Dt, scale=2.0), r(V))


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_chunked_divergence_drop_in_equals_trls_kernel(beta):
    hs, ws, bs, ht, wt, bt = _heads()
    args = (beta, 1.5, 0.8, 5.0, 1.2, 7.0)  # temperature, scales and softcaps
    g = torch.randn(hs.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs = []
    for fn in (ChunkedDivergenceFunction, fce_trl.ChunkedDivergenceFunction, _ExactDivergence):
        leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
        div, ent = fn.apply(*leaves, ht, wt, bt, *args)
        assert not ent.requires_grad
        outs.append([div.detach(), ent] + list(torch.autograd.grad((div * g).sum(), leaves)))
    trls, ours, exact = outs
    for a, b, c in zip(ours, trls, exact):
        assert rel_err(a, c) <= 1e-6 and rel_err(a, b) <= 1e-5  # TRL's float32 buffers


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_chunked_divergence_loss_equals_trls(beta):
    hs, ws, bs, ht, wt, bt = _heads()
    mask = torch.ones(hs.shape[0], dtype=torch.long)
    mask[[1, 4, 5]] = 0
    for items in (None, torch.tensor(20.0)):
        outs = []
        for fn in (trl_distill._chunked_divergence_loss, fce_trl.chunked_divergence_loss):
            leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
            loss, ent, n = fn(leaves[0], ht, leaves[1], wt, mask, beta, items, leaves[2], bt,
                              0.9, 1.1, None, 8.0, 0.8)
            outs.append([loss.detach(), ent, n] + list(torch.autograd.grad(loss, leaves)))
        for a, b in zip(*outs):
            assert rel_err(b.double(), a.double()) <= 1e-5


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_divergence_drop_in_under_autocast_differentiates_its_forward(beta):
    # Trainers call backward after the autocast block: the gradient must still be that
    # of the bf16 forward, the same as casting the hidden states by hand (float32 weights
    # are master weights, the products in bf16; float32 biases are added to float32
    # logits, as TRL adds them).
    hs, ws, bs, ht, wt, bt = _heads(torch.float32)
    g = torch.randn(hs.shape[0], generator=torch.Generator().manual_seed(2))
    outs = []
    for autocast in (True, False):
        leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            args = leaves + [ht, wt, bt] if autocast else \
                [leaves[0].bfloat16(), leaves[1], leaves[2], ht.bfloat16(), wt, bt]
            div, ent = fce_trl.ChunkedDivergenceFunction.apply(*args, beta, 1.5)
        outs.append([div, ent] + list(torch.autograd.grad((div * g).sum(), leaves)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", ["divergence", "logprobs"])
def test_drop_ins_take_a_float32_bias_beside_bf16_heads(fn):
    # TRL's semantics: the divergence adds the float32 bias to float32 logits; the
    # log-prob head rounds it to the logits' bf16.
    from trl.kernels import ChunkedLogProbFunction

    hs, ws, bs, ht, wt, bt = (t.float() for t in _heads())
    hs, ws, ht, wt = (t.bfloat16() for t in (hs, ws, ht, wt))
    leaves = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    y = torch.randint(0, V, (hs.shape[0],), generator=torch.Generator().manual_seed(3))
    if fn == "divergence":
        ours = fce_trl.ChunkedDivergenceFunction.apply(*leaves, ht, wt, bt, 0.5)[0]
        exact = _ExactDivergence.apply(*leaves, ht, wt, bt, 0.5)[0]
        theirs = ChunkedDivergenceFunction.apply(*leaves, ht, wt, bt, 0.5)[0]
    else:
        def call(f, b):
            return f.apply(leaves[0], leaves[1], b, y, 1.0, 32, None, 1.0, ("log_probs",))[0]
        ours, theirs = call(fce_trl.ChunkedLogProbFunction, leaves[2]), \
            call(ChunkedLogProbFunction, leaves[2])
        z = (F.linear(hs, ws) + bs.bfloat16()).double()  # rounded as TRL's tile
        exact = z.log_softmax(-1).gather(-1, y[:, None])[:, 0]
    bar = 1e-5 if fn == "divergence" else 2 ** -7  # float32 logits; bf16 ones
    assert rel_err(ours.double(), exact.double()) <= bar
    assert rel_err(theirs.double(), exact.double()) <= 2 ** -7
    grad = torch.autograd.grad(ours.sum(), leaves)
    assert [t.dtype for t in grad] == [torch.bfloat16, torch.bfloat16, torch.float32]


def test_the_docs_example_trains(tmp_path):
    # docs/distillation.md's block, as written, on the tiny models
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "distillation.md").read_text()
    block, = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def distill(" in b]
    namespace = {}
    exec(compile(block, "docs/distillation.md", "exec"), namespace)
    config = trl.DistillationConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
        max_completion_length=4, max_steps=1, report_to=[], use_cpu=DEVICE == "cpu",
        bf16=False, logging_steps=1)
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7"] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices
        trainer = namespace["distill"](_model(32, 0), _model(48, 1), config, data,
                                       word_tokenizer(V))
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    assert "_compute_loss" not in vars(trainer)  # reverted

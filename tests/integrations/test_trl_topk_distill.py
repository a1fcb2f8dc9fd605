"""torch_fce.integrations.trl on TRL 1.16's experimental top-k distillation trainers,
offline: ServerDistillationTrainer with its teacher server replaced by a local teacher's
linear_topk_logprobs (tiny float64 llamas), apply(trainer) gives TRL's loss and every
student gradient (beta 0 over the top-k, the sparse top-1 paths at beta > 0, tail on and
off, train and eval); AsyncDistillationTrainer's served divergence against TRL's own
(loss, gradients, metrics, per-teacher statistics) and through a real trainer's
compute_loss; training steps run; refusals warn and keep TRL's; revert."""

import math
import queue
import warnings

import datasets
import numpy as np
import pytest
import torch
import transformers

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL's experimental-API notice
    import trl.generation.vllm_client as trl_vllm_client
    from trl.experimental.async_distillation import (AsyncDistillationConfig,
                                                     AsyncDistillationTrainer)
    from trl.experimental.async_distillation import async_distillation_trainer as trl_async
    from trl.experimental.server_distillation import (ServerDistillationConfig,
                                                      ServerDistillationTrainer)

import torch_fce
from torch_fce.integrations import trl as fce_trl
from torch_fce.integrations.trl.topk_distill import chunked_jsd_loss
from torch_fce.testing import rel_err, word_tokenizer

from tests.helpers import trainer_loss_step

V, TOP_K = 96, 5


def _model(hidden, seed, dtype=torch.float64):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=1, eos_token_id=2, bos_token_id=None)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # peaked distributions, as trained heads have
        model.get_output_embeddings().weight.mul_(8.0)
    return model


TEACHER = _model(48, 1).eval()


def _teacher_rows(seq, start, k, temperature):
    """The teacher's top-k log-probs of the tokens seq[start:] and theirs, from its
    hidden states through linear_topk_logprobs (what a vLLM server returns)."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        hidden = TEACHER.model(input_ids=ids).last_hidden_state[0, start - 1:-1]
    return torch_fce.linear_topk_logprobs(
        hidden, TEACHER.get_output_embeddings().weight, k, target=ids[0, start:],
        temperature=temperature)


class _LocalTeacher:
    """trl.generation.vllm_client.VLLMClient's get_sequence_logprobs, served locally."""

    def __init__(self, *args, **kwargs):
        pass

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100,
                              temperature=1.0, **kwargs):
        out = dict(logprobs=[], logprob_token_ids=[], actual_logprobs=[])
        for seq, start in zip(sequences, prompt_lengths):
            top = _teacher_rows(seq, start, top_logprobs, temperature)
            out["logprobs"].append(top.logprobs.float().tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append(top.target_logprob.float()[:, None].tolist())
        return out


def _server(tmp_path, monkeypatch, **config):
    monkeypatch.setattr(trl_vllm_client, "VLLMClient", _LocalTeacher)
    defaults = dict(output_dir=str(tmp_path / "out"), teacher_model_server_url="http://x:1",
                    per_device_train_batch_size=2, max_completion_length=4, max_steps=1,
                    report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                    gradient_accumulation_steps=2, logging_steps=1)
    args = ServerDistillationConfig(**{**defaults, **config})
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7"] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ServerDistillationTrainer(model=_model(32, 0), args=args, train_dataset=data,
                                            processing_class=word_tokenizer(V))
    trainer.current_gradient_accumulation_steps = 2  # set by train(); read by the loss
    return trainer


def _server_batch():
    g = torch.Generator().manual_seed(4)
    B, P, C = 3, 4, 6
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g),
                 prompt_mask=torch.ones(B, P, dtype=torch.long),
                 completion_ids=torch.randint(3, V, (B, C), generator=g),
                 completion_mask=torch.ones(B, C, dtype=torch.long))
    batch["prompt_mask"][0, :2] = 0  # left padding
    batch["prompt_ids"][0, :2] = 1
    batch["completion_mask"][1, 3:] = 0  # right padding after an EOS
    batch["completion_ids"][1, 3:] = 1
    # a sampled token equal to the teacher's top-1 (the beta > 0 support reads it once)
    seq = [t for t, m in zip(batch["prompt_ids"][2].tolist(), batch["prompt_mask"][2]) if m]
    batch["completion_ids"][2, 0] = _teacher_rows(seq + [0], len(seq), 1, 1.0).indices[0, 0]
    batch["num_items_in_batch"] = torch.tensor(99.0)  # unused by TRL's server loss
    return batch


def _apply(trainer, method):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served: no refusal
        fce_trl.apply(trainer)
    assert method in vars(trainer)


def _same(got, want, tol=1e-6):
    # TRL forms the teacher's tail bucket and renormalisation in the teacher's float32
    # (torch.where with a 0-dim float64 -inf keeps its dtype), torch_fce in the student's
    # math dtype (float64 here): TRL's float32 rounding is the tolerance
    assert rel_err(got[0], want[0]) <= tol, (got[0], want[0])
    assert want[1].keys() == got[1].keys() and len(got[1]) > 0
    for name, g in want[1].items():
        assert rel_err(got[1][name], g) <= tol, name


@pytest.mark.parametrize("beta, top_k", [(0.0, TOP_K), (0.4, 1), (1.0, 1)])
def test_server_apply_gives_trls_loss_and_gradients(tmp_path, monkeypatch, beta, top_k):
    trainer = _server(tmp_path, monkeypatch, beta=beta, loss_top_k=top_k, temperature=0.8)
    batch = _server_batch()
    for tail, mode in ((True, "train"), (False, "train"), (True, "eval")):
        trainer.loss_add_tail = tail
        want = trainer_loss_step(trainer, batch, mode)
        _apply(trainer, "compute_loss")
        got = trainer_loss_step(trainer, batch, mode)
        fce_trl.revert(trainer)
        assert want[0] != 0 or (beta > 0 and not tail), (tail, mode)
        _same(got, want)
    assert "compute_loss" not in vars(trainer)
    assert torch.equal(trainer_loss_step(trainer, batch, "eval")[0], want[0])  # TRL's own again


def test_server_keeps_trls_checks_and_return_outputs(tmp_path, monkeypatch):
    trainer = _server(tmp_path, monkeypatch, beta=0.5, loss_top_k=1)
    batch = _server_batch()
    _apply(trainer, "compute_loss")
    with pytest.warns(UserWarning, match="return_outputs"):
        loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert outputs.logits.shape[-1] == V
    missing = dict(actual_logprobs=[[[-math.inf]] * 6] * 3)

    def served(*args, **kwargs):
        return {**_LocalTeacher().get_sequence_logprobs(*args, **kwargs), **missing}

    monkeypatch.setattr(trainer.teacher_client, "get_sequence_logprobs", served)
    with pytest.raises(ValueError, match="missing actual-token logprobs"):
        trainer.compute_loss(trainer.model, batch)


def test_server_refusals_warn_and_keep_trls(tmp_path, monkeypatch):
    trainer = _server(tmp_path, monkeypatch, beta=0.5, loss_top_k=1)
    trainer.reverse_kl_top_1_mode = "argmax"  # TRL's config refuses it; a subclass might not
    with pytest.warns(UserWarning, match="reverse_kl_top_1_mode"):
        fce_trl.apply(trainer)
    assert "compute_loss" not in vars(trainer)

    class Mine(ServerDistillationTrainer):
        def _compute_server_forward_kl_loss(self, *args, **kwargs):
            return super()._compute_server_forward_kl_loss(*args, **kwargs)

    trainer.__class__ = Mine
    trainer.reverse_kl_top_1_mode = "sampled"
    with pytest.warns(UserWarning, match="overrides _compute_server_forward_kl_loss"):
        fce_trl.apply(trainer)


def test_server_training_step_runs(tmp_path, monkeypatch):
    trainer = _server(tmp_path, monkeypatch, beta=0.0, loss_top_k=TOP_K, loss_add_tail=True)
    before = trainer.model.get_output_embeddings().weight.detach().clone()
    _apply(trainer, "compute_loss")
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(math.isfinite(x) and x > 0 for x in losses)
    assert not torch.equal(trainer.model.get_output_embeddings().weight, before)


# ---- AsyncDistillationTrainer --------------------------------------------------------

def _async_inputs(n, D, K, seed, teachers=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (n, K), generator=g)
    lp = (torch.randn(n, K, generator=g, dtype=torch.float64).log_softmax(-1) - 0.2).float()
    valid = torch.rand(n, K, generator=g) < 0.8
    valid[:, 0] = True  # TRL passes only positions with teacher signal
    ids = torch.where(valid, ids, -1)
    idx = None if teachers is None else torch.randint(0, teachers, (n,), generator=g)
    return hidden, weight, bias, ids, lp, valid, idx


@pytest.mark.parametrize("beta, tail, teachers", [(0.0, True, None), (0.3, False, 3),
                                                  (1.0, True, None), (0.5, True, 2)])
def test_async_served_divergence_equals_trls(beta, tail, teachers):
    hidden, weight, bias, ids, lp, valid, idx = _async_inputs(13, 8, 6, 1, teachers)
    args = (0.7, 6.0, ids, lp, valid, beta, 0.8, tail, idx, teachers or 1, 4)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        out = fn(*leaves[:3], *args)
        return out, torch.autograd.grad(out[0], leaves)

    got, want = run(chunked_jsd_loss), run(trl_async._chunked_jsd_loss)
    for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])):
        # TRL's float32 products of float64 inputs: float32's rounding
        assert rel_err(a.double(), b.double()) <= 1e-5


class _StubWorker:
    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()

    def start(self):
        pass

    stop = start

    def update_model_version(self, version):
        pass

    def check_health(self, seconds):
        pass


class _NoTransfer:
    def init_weight_transfer(self):
        pass

    pause = resume = destroy = init_weight_transfer

    def send_weights(self, weights):
        for _ in weights:
            pass


def _async(tmp_path, monkeypatch, **config):
    monkeypatch.setattr(trl_async, "get_peak_flops_per_device", lambda *a: None)  # CUDA only
    monkeypatch.setattr(trl_async, "VLLMClient", lambda *a, **k: None)  # the student's
    student = tmp_path / "student"
    _model(32, 0, torch.float32).save_pretrained(student)
    defaults = dict(output_dir=str(tmp_path / "out"), teacher_top_k=TOP_K, token_budget=-1,
                    use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
                    per_device_train_batch_size=2, max_completion_length=6, max_steps=1,
                    gradient_accumulation_steps=2,
                    model_init_kwargs={"attn_implementation": "sdpa"})
    args = AsyncDistillationConfig(**{**defaults, **config})
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "w3"}]] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = AsyncDistillationTrainer(
            model=str(student), args=args, train_dataset=data,
            processing_class=word_tokenizer(V), rollout_worker=_StubWorker(),
            weight_transfer=_NoTransfer())
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _rollout(prompt, completion, temperature):
    """A rollout sample as TRL's worker packs it: per position the teacher's top-k and
    the sampled token's own entry when outside them (padded -1 / -inf), from
    linear_topk_logprobs of the local teacher."""
    seq = prompt + completion
    top = _teacher_rows(seq, len(prompt), TOP_K, temperature)
    ids = np.full((len(seq), TOP_K + 1), -1, np.int64)
    lps = np.full((len(seq), TOP_K + 1), -np.inf, np.float32)
    for i, p in enumerate(range(len(prompt), len(seq))):
        cid, clp = top.indices[i].tolist(), top.logprobs[i].tolist()
        if seq[p] not in cid:
            cid.append(seq[p])
            clp.append(top.target_logprob[i].item())
        ids[p, :len(cid)], lps[p, :len(clp)] = cid, clp
    return dict(input_ids=np.array(seq), teacher_topk_ids=ids, teacher_topk_logprobs=lps,
                completion_mask=np.array([0] * len(prompt) + [1] * len(completion)),
                teacher_id="default", prompt_id=0, metrics={})


@pytest.mark.parametrize("beta, tail", [(0.0, True), (0.5, False), (1.0, True)])
def test_async_apply_gives_trls_loss_gradients_and_metrics(tmp_path, monkeypatch, beta,
                                                           tail):
    trainer = _async(tmp_path, monkeypatch, beta=beta, add_tail_bucket=tail,
                     teacher_temperature=0.8)
    top1 = _teacher_rows([3, 4, 5, 0], 3, 1, 0.8).indices[0, 0].item()
    samples = [_rollout([3, 4, 5], [top1, 9, 40, 7, 2], 0.8), _rollout([6, 7], [11, 5, 3], 0.8)]
    batch = trl_async.DataCollatorForRollout(pad_token_id=1, num_processes=1).torch_call(
        [[samples]])

    def step():
        trainer.model.train()
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        metrics = {k: trainer._metrics["train"][k][-1] for k in
                   ("jsd", "entropy", "teacher_entropy")}
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                               if p.grad is not None}, metrics

    want = step()
    _apply(trainer, "_compute_loss")
    got = step()
    _same(got, want, tol=2e-5)  # TRL's float32 logits both
    for k, v in want[2].items():
        assert abs(got[2][k] - v) <= 2e-5 * abs(v), k
    fce_trl.revert(trainer)
    assert "_compute_loss" not in vars(trainer)


def test_the_docs_example_trains(tmp_path, monkeypatch):
    # docs/distillation.md's server block, as written, on the tiny models
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "distillation.md").read_text()
    block, = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
              if "def distill_from_server" in b]
    namespace = {}
    exec(compile(block, "docs/distillation.md", "exec"), namespace)
    monkeypatch.setattr(trl_vllm_client, "VLLMClient", _LocalTeacher)
    config = ServerDistillationConfig(
        output_dir=str(tmp_path / "out"), teacher_model_server_url="http://x:1", beta=0.0,
        loss_top_k=TOP_K, per_device_train_batch_size=2, max_completion_length=4,
        max_steps=1, report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7"] * 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = namespace["distill_from_server"](_model(32, 0), config, data,
                                                   word_tokenizer(V))
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    assert "compute_loss" not in vars(trainer)  # reverted


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_reference_copies_are_trls_own(beta):
    # tests/references.py's sparse divergence composes TRL's _add_tail_bucket and
    # _jsd_divergence from copies: each held to TRL's function, bit for bit, on float64
    # log-probs with invalid (-inf) and confident entries
    from trl.experimental.server_distillation import server_distillation_trainer as trl_server

    from tests.references import add_tail_bucket, jsd_divergence

    g = torch.Generator().manual_seed(4)
    s = torch.randn(6, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    t = torch.randn(6, 7, generator=g, dtype=torch.float64).log_softmax(-1) - 0.1
    s[0, :6] = -40.0  # a confident row: its top entry holds nearly all the mass
    mask = torch.rand(6, 7, generator=g) > 0.2
    s, t = torch.where(mask, s, -math.inf), torch.where(mask, t, -math.inf)
    for mine, trls in ((add_tail_bucket(s, mask), trl_server._add_tail_bucket(s, mask)),
                       (add_tail_bucket(t, mask), trl_server._add_tail_bucket(t, mask))):
        assert all(torch.equal(a, b) for a, b in zip(mine, trls))
    (s1, m1), (t1, _) = add_tail_bucket(s, mask), add_tail_bucket(t, mask)
    for args in ((s, t, beta, mask), (s1, t1, beta, m1)):
        assert torch.equal(jsd_divergence(*args), trl_server._jsd_divergence(*args))

"""transformers integration: patched causal LMs give the unpatched loss and gradients."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_fce.integrations import transformers as fce_hf  # noqa: E402
from torch_fce.testing import grad_tol, rel_err  # noqa: E402

pytestmark = pytest.mark.integration
V = 128
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=4.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    # MoE: the router load-balancing loss joins the loss when labels are given.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
}


def make(family, seed=0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    return getattr(transformers, model_cls)(config).train()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    return ids, labels


def loss_and_grads(model, **kwargs):
    model.zero_grad()
    out = model(**kwargs)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


CASES = {
    "ignored": lambda ids, labels: dict(input_ids=ids, labels=labels),
    "num_items_in_batch": lambda ids, labels: dict(
        input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40)),
    "shift_labels": lambda ids, labels: dict(
        input_ids=ids, labels=labels, shift_labels=torch.roll(labels, -1, 1)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_family_matches_unpatched(family, case):
    model = make(family)
    kwargs = CASES[case](*batch())
    ref, ref_grads = loss_and_grads(model, **kwargs)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, **kwargs)
    assert out.logits is None
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(torch.float32, V), k


def test_transformers_outputs_have_no_logits_by_attribute_key_or_tuple():
    model = make("llama")
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels, return_dict=False)
    fce_hf.apply(model)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and "logits" not in out and out[0] is out.loss
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and rel_err(tup[0], ref[0]) <= 1e-5
    assert len(tup) == len(ref) - 1  # (loss, cache): the logits slot is absent, as for None


def test_transformers_deepcopy_runs_its_own_parameters():
    import copy

    model = fce_hf.apply(make("llama"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ref = make("llama")  # unpatched, parameters halved the same way
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    ids, labels = batch()
    got = twin(input_ids=ids, labels=labels)
    assert got.logits is None  # the copy is patched too
    assert rel_err(got.loss, ref(input_ids=ids, labels=labels).loss) <= 1e-5


def test_transformers_eval_and_no_labels_behave_as_unpatched():
    model = make("gemma2")
    ids, labels = batch()
    with torch.no_grad():
        ref = model(ids).logits
        fce_hf.apply(model)
        assert torch.equal(model(ids).logits, ref)
        model.eval()
        out = model(ids, labels=labels)
        assert out.logits is not None and torch.isfinite(out.loss)
    fce_hf.revert(model)
    assert "forward" not in vars(model)


def test_transformers_lm_head_bias():
    model = make("llama")
    model.lm_head = torch.nn.Linear(32, V, bias=True)
    kwargs = CASES["ignored"](*batch())
    ref, ref_grads = loss_and_grads(model, **kwargs)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, **kwargs)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert rel_err(grads["lm_head.bias"], ref_grads["lm_head.bias"]) <= 1e-5


def test_transformers_unknown_logit_transform_is_refused():
    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    config = transformers.LlamaConfig(**COMMON)
    with pytest.raises(ValueError, match="cannot serve"):
        fce_hf.apply(Scaled(config))


def _refit(model, logits, labels, loss_of):
    """A family's output with its own (non-standard) logits and loss."""
    return transformers.modeling_outputs.CausalLMOutputWithPast(
        loss=None if labels is None else loss_of(logits, labels), logits=logits)


def _shifted_ce(z, labels):
    return torch.nn.functional.cross_entropy(z[:, :-1].flatten(0, 1).float(),
                                             labels[:, 1:].flatten())


class _Custom(transformers.LlamaForCausalLM):
    """logits = post(lm_head(hidden)); loss = loss_of(logits, labels)."""
    post = staticmethod(lambda self, z: z)
    loss_of = staticmethod(_shifted_ce)

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        return _refit(self, self.post(self, self.lm_head(hidden)), labels,
                      type(self).loss_of)


def _custom(post=None, loss_of=None, init=None):
    attrs = {k: staticmethod(v) for k, v in (("post", post), ("loss_of", loss_of)) if v}
    cls = type("Custom", (_Custom,), attrs)
    torch.manual_seed(0)
    model = cls(transformers.LlamaConfig(**COMMON))
    if init:
        init(model)
    return model


REFUSED = {
    "learnable logit scale": dict(
        init=lambda m: m.register_parameter("scale", torch.nn.Parameter(torch.ones(()))),
        post=lambda self, z: z * self.scale),
    "unshifted loss": dict(loss_of=lambda z, y: torch.nn.functional.cross_entropy(
        z.flatten(0, 1).float(), y.flatten())),
    "own z-loss": dict(loss_of=lambda z, y: _shifted_ce(z, y) + 1e-4 * (
        torch.logsumexp(z.float(), -1) ** 2).mean()),
    "softcap 1000 not in config": dict(post=lambda self, z: 1000.0 * torch.tanh(z / 1000.0)),
    "multiplier 0.999": dict(post=lambda self, z: z * 0.999),
}


@pytest.mark.parametrize("case", REFUSED)
def test_transformers_family_it_cannot_reproduce_is_refused(case):
    model = _custom(**REFUSED[case])
    with pytest.raises(ValueError, match="cannot serve"):
        fce_hf.apply(model)
    assert "forward" not in vars(model.lm_head)  # left as it was


def test_transformers_standard_custom_family_is_served():
    model = _custom()
    ids, labels = batch()
    ref, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    fce_hf.apply(model)
    assert rel_err(model(input_ids=ids, labels=labels).loss, ref.loss) <= 1e-5


def test_transformers_apply_leaves_modes_and_config_as_they_were():
    model = make("llama")
    model.model.layers[0].eval()  # mixed modes: only this layer in eval
    config = dict(vars(model.config))
    modes = [m.training for m in model.modules()]
    fce_hf.apply(model)
    assert [m.training for m in model.modules()] == modes
    assert vars(model.config) == config


def test_transformers_labels_passed_positionally():
    model = make("llama")
    ids, labels = batch()
    position = list(inspect.signature(model.forward).parameters).index("labels")
    args = [ids] + [None] * (position - 1) + [labels]
    ref = model(*args).loss
    fce_hf.apply(model)
    assert rel_err(model(*args).loss, ref) <= 1e-5


class _RenamedCoefficient(transformers.MixtralForCausalLM):
    """An MoE family whose router-loss coefficient has another attribute name."""

    def __init__(self, config):
        super().__init__(config)
        self.aux_loss_alpha = self.router_aux_loss_coef
        del self.router_aux_loss_coef

    def forward(self, *args, **kwargs):
        self.router_aux_loss_coef = self.aux_loss_alpha
        try:
            return super().forward(*args, **kwargs)
        finally:
            del self.router_aux_loss_coef


def test_transformers_moe_coefficient_under_another_name():
    torch.manual_seed(0)
    _, _, extra = FAMILIES["mixtral"]
    model = _RenamedCoefficient(transformers.MixtralConfig(**COMMON, **extra)).train()
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(torch.float32, V), k


def test_transformers_user_tensors_unchanged():
    model = fce_hf.apply(make("qwen2"))
    ids, labels = batch()
    before = ids.clone(), labels.clone()
    model(input_ids=ids, labels=labels).loss.backward()
    assert torch.equal(ids, before[0]) and torch.equal(labels, before[1])


def test_transformers_training_converges_like_unpatched():
    def train(patch):
        model = make("llama", seed=1)
        if patch:
            fce_hf.apply(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(20):
            ids, labels = batch(seed=step % 4)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, list(model.parameters())

    losses, params = train(True)
    ref_losses, ref_params = train(False)
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    for p, q in zip(params, ref_params):
        assert rel_err(p, q) <= 1e-4


def test_transformers_compiled():
    model = make("llama")
    kwargs = CASES["num_items_in_batch"](*batch())
    ref, ref_grads = loss_and_grads(model, **kwargs)
    fce_hf.apply(model)
    compiled = torch.compile(model)
    model.zero_grad()
    out = compiled(**kwargs)
    out.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert rel_err(model.lm_head.weight.grad, ref_grads["lm_head.weight"]) <= 1e-5


def test_transformers_trainer(tmp_path):
    model = fce_hf.apply(make("llama"))
    data = [dict(input_ids=ids, labels=labels) for ids, labels in
            (tuple(t[0] for t in batch(seed=s)) for s in range(8))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_transformers_logits_to_keep():
    model = make("llama")
    ids, labels = batch()
    kwargs = dict(input_ids=ids, labels=labels[:, -5:], logits_to_keep=5)
    ref, ref_grads = loss_and_grads(model, **kwargs)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, **kwargs)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert rel_err(grads["lm_head.weight"], ref_grads["lm_head.weight"]) <= 1e-5

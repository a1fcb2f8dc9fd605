"""transformers integration: patched causal LMs give the unpatched loss and gradients."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_fce.integrations import transformers as fce_hf  # noqa: E402
from torch_fce.testing import rel_err  # noqa: E402
from tests.helpers import grad_tol

pytestmark = pytest.mark.integration
# The GPU tier runs this module on CUDA (README); CI on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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
    # logits_scaling divides the hidden states before the head (Granite's the logits).
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM",
                 dict(dim_model_base=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, kv_lora_rank=16, q_lora_rank=16)),
    # MoE: the router load-balancing loss joins the loss when labels are given.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
}


def make(family, seed=0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    return getattr(transformers, model_cls)(config).train().to(DEVICE)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 7] = -100
    return ids.to(DEVICE), labels.to(DEVICE)


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
    model.lm_head = torch.nn.Linear(32, V, bias=True, device=DEVICE)
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
    return model.to(DEVICE)


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
    assert_refused_as_it_was(_custom(**REFUSED[case]), "cannot serve")


def test_transformers_standard_custom_family_is_served():
    model = _custom()
    ids, labels = batch()
    ref, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    fce_hf.apply(model)
    assert rel_err(model(input_ids=ids, labels=labels).loss, ref.loss) <= 1e-5


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_state_dict_hooks", "_load_state_dict_pre_hooks")


PATCH_ATTRIBUTES = {"forward", "_old_forward", "_torch_fce_original_forward",
                    "_torch_fce_options"}


def fingerprint(model, skip=()):
    """What apply() must leave as it was: per module its identity, type, mode, every
    attribute (by value for plain values, else by identity; but those in skip) and
    every parameter, buffer, submodule and hook; buffer values; the config."""
    def key(v):
        return v if isinstance(v, (str, int, float, bool, type(None))) else id(v)

    modules = [(name, id(m), type(m), m.training,
                {k: key(v) for k, v in vars(m).items() if k not in skip},
                *({k: id(v) for k, v in getattr(m, d).items()}
                  for d in ("_parameters", "_buffers", "_modules") + _HOOKS))
               for name, m in model.named_modules()]
    buffers = [(n, b.detach().cpu().clone()) for n, b in model.named_buffers()]
    return modules, _Values(buffers), model.config.to_dict()


def fingerprint_of(saved, skip):
    """A saved fingerprint without the attributes in skip."""
    modules, buffers, config = saved
    return ([(*m[:4], {k: v for k, v in m[4].items() if k not in skip}, *m[5:])
             for m in modules], buffers, config)


def assert_same(got, want):
    """Fingerprints equal, or an error naming the first module and attribute that
    differ."""
    for a, b in zip(got[0], want[0]):
        if a != b:
            fields = ("name", "id", "type", "training", "attributes", "parameters",
                      "buffers", "modules") + _HOOKS
            diff = [f for f, x, y in zip(fields, a, b) if x != y]
            keys = sorted(k for k in set(a[4]) | set(b[4]) if a[4].get(k) != b[4].get(k))
            raise AssertionError(f"module {a[0]!r}: {diff} differ (attributes {keys})")
    assert len(got[0]) == len(want[0]) and got[1:] == want[1:]


def assert_refused_as_it_was(model, match):
    """apply() raises a ValueError matching `match` and leaves the model as it was."""
    before = fingerprint(model)
    with pytest.raises(ValueError, match=match):
        fce_hf.apply(model)
    assert_same(fingerprint(model), before)


class _Values(list):
    def __eq__(self, other):
        return len(self) == len(other) and all(
            n == m and torch.equal(a, b) for (n, a), (m, b) in zip(self, other))


def _bigbird():
    torch.manual_seed(0)
    config = transformers.BigBirdConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, attention_type="block_sparse",
        block_size=2, num_random_blocks=2, is_decoder=True)
    return transformers.BigBirdForCausalLM(config).train().to(DEVICE)


def _mixed_modes():
    model = make("llama")
    model.model.layers[0].eval()  # only this layer in eval
    return model


@pytest.mark.parametrize("build", [_mixed_modes, _bigbird, lambda: make("mixtral")],
                         ids=["llama_mixed_modes", "bigbird_block_sparse", "mixtral"])
def test_transformers_apply_leaves_the_model_exactly_as_it_was(build):
    # BigBird switches to full attention for good on a short input and builds new
    # attention modules (in eval mode, during the check's forward): all undone.
    model = build()
    before = fingerprint(model)
    fce_hf.apply(model)
    # apply()'s own attributes aside (the model's forward and its marks, the head's
    # capture), everything is as it was
    assert_same(fingerprint(model, skip=PATCH_ATTRIBUTES), fingerprint_of(before, PATCH_ATTRIBUTES))
    fce_hf.revert(model)
    assert_same(fingerprint(model), before)


def test_transformers_apply_keeps_shared_sub_configs_shared():
    # multimodal families hold their text config both in model.config and in the
    # language model: after apply(), still the same object
    model = make("llama")
    sub = transformers.LlamaConfig(**COMMON)
    model.config.text_config = sub
    model.model.text_config = sub
    fce_hf.apply(model)
    assert model.config.text_config is sub and model.model.text_config is sub


def test_transformers_apply_keeps_the_rng_streams():
    model = make("llama")
    torch.manual_seed(5)
    fce_hf.apply(model)
    got = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), got)


class _Doubled(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def _with_head(head_fn):
    def build():
        model = make("llama")
        head_fn(model)
        return model
    return build


def _extra_parameter(model):
    model.lm_head.register_parameter("offset", torch.nn.Parameter(torch.zeros(V, device=DEVICE)))


def _dory():
    if not hasattr(transformers, "DoryConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Dory")
    torch.manual_seed(0)
    config = transformers.DoryConfig(**{k: v for k, v in COMMON.items()})
    return transformers.DoryForCausalLM(config).train().to(DEVICE)


HEADS = {
    "subclass with its own forward": _with_head(lambda m: setattr(
        m, "lm_head", _Doubled(32, V, bias=False, device=DEVICE))),
    "dory per-class logit scale": _dory,
    "extra parameter": _with_head(_extra_parameter),
    "extra buffer": _with_head(lambda m: m.lm_head.register_buffer(
        "mask", torch.ones(V, device=DEVICE))),
    "forward hook": _with_head(lambda m: m.lm_head.register_forward_hook(
        lambda mod, args, out: out * 2)),
    "forward pre-hook": _with_head(lambda m: m.lm_head.register_forward_pre_hook(
        lambda mod, args: (args[0] * 2,))),
    "instance forward": _with_head(lambda m: setattr(
        m.lm_head, "forward", lambda x: torch.nn.Linear.forward(m.lm_head, x) * 2)),
}


@pytest.mark.parametrize("case", HEADS)
def test_transformers_head_that_is_not_a_plain_linear_is_refused(case):
    assert_refused_as_it_was(HEADS[case](), "cannot serve .*lm_head|output embeddings")


def test_transformers_apply_refuses_bad_options_naming_them():
    model = make("llama")
    with pytest.raises(ValueError, match="label_smoothing"):
        fce_hf.apply(model, label_smoothing=2.0)
    with pytest.raises(ValueError, match="accumulator"):
        fce_hf.apply(model, accumulator="bf16")
    assert "forward" not in vars(model)


def _dispatched(offload=False):
    """llama dispatched by accelerate with hooks on every module, on DEVICE (a body
    offloaded to the CPU would swap its parameters at every forward: that case is
    test_transformers_moe_aux_loss_and_head_on_different_devices)."""
    from accelerate import cpu_offload, dispatch_model

    model = make("llama").cpu()
    if offload:
        return cpu_offload(model, execution_device=DEVICE)
    return dispatch_model(model, device_map={"model": DEVICE, "lm_head": DEVICE},
                          force_hooks=True)


def test_transformers_accelerate_dispatched_model_trains_with_its_hooks():
    model = _dispatched()
    ids, labels = (t.cpu() for t in batch())  # the hooks move them
    assert hasattr(model.lm_head, "_hf_hook") and "forward" in vars(model)
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    before = fingerprint(model)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert out.logits is None and rel_err(out.loss, ref.loss) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(torch.float32, V), k
    fce_hf.revert(model)
    assert_same(fingerprint(model), before)  # accelerate's hooks and wrappers included
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref.logits.detach())


def test_transformers_accelerate_offloaded_head_is_refused():
    assert_refused_as_it_was(_dispatched(offload=True), "offloaded")


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
    model.to(DEVICE)
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


@pytest.mark.cuda
def test_transformers_bf16_cuda_model_with_a_large_vocabulary():
    # The first GPU run of apply() crashed here (designed logits made on the CPU and
    # indexed by CUDA labels): a bf16 llama with a 32k vocabulary, against its own loss.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 32000, "hidden_size": 64})
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (2, 64), generator=g).cuda()
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert out.logits is None and rel_err(out.loss, ref.loss) <= 1e-3
    # both round the logits to bf16; the unpatched backward also rounds their gradient
    assert rel_err(grads["lm_head.weight"], ref_grads["lm_head.weight"]) <= 2e-2


@pytest.mark.cuda
def test_transformers_default_device_cuda():
    ids, labels = batch()
    torch.set_default_device("cuda")
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).train()
        ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
        fce_hf.apply(model)
        out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    finally:
        torch.set_default_device(None)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert rel_err(grads["lm_head.weight"], ref_grads["lm_head.weight"]) <= 1e-5


@pytest.mark.cuda
def test_transformers_moe_aux_loss_and_head_on_different_devices():
    # mixtral's body offloaded to the CPU by accelerate (its weights brought to the GPU
    # at each forward), its head on the GPU: the same loss and gradients.
    from accelerate import dispatch_model

    model = dispatch_model(make("mixtral").cpu(), device_map={"model": "cpu",
                                                               "lm_head": "cuda"})
    ids, labels = (t.cpu() for t in batch())
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    fce_hf.apply(model)
    out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert rel_err(out.loss.cpu(), ref.loss.cpu()) <= 1e-5
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= grad_tol(torch.float32, V), k


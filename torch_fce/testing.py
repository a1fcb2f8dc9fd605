"""Input builders the benchmarks and the tests share: random problems, the relative
error, a tokenizer for TRL's trainers. The tests' own references and tolerances are in
tests/helpers.py."""

import torch


def make_inputs(N, D, V, dtype=torch.float32, *, ignore_frac=1 / 17, bias=False,
                class_weight=False, weight_dtype=None, device="cpu", seed=0,
                weight_scale=1.0):
    """hidden ~ randn/sqrt(D), weight ~ weight_scale * randn, targets uniform with a
    fraction set to -100. Returns dict(hidden, weight, target, bias, class_weight)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64) / max(D, 1) ** 0.5
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * weight_scale
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < ignore_frac] = -100
    out = dict(
        hidden=hidden.to(dtype),
        weight=weight.to(weight_dtype or dtype),
        target=target,
        bias=(torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(weight_dtype or dtype)
        if bias else None,
        class_weight=torch.rand(V, generator=g) + 0.1 if class_weight else None,
    )
    return {k: v if v is None else v.to(device) for k, v in out.items()}


def rel_err(actual, expected):
    """Relative L2 error ||a - e|| / ||e|| in float64 (0 when both are 0)."""
    if actual.shape != expected.shape:  # broadcasting would compare the wrong elements
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    den = e.norm()
    return float((a - e).norm() / den) if den > 0 else float((a - e).norm())


def word_tokenizer(V):
    """A word-level tokenizer over V made-up words w0 ... w{V-1} (w0 unknown, w1
    padding, w2 end of sequence): TRL's trainers need one."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w1",
                                                eos_token="w2", unk_token="w0")

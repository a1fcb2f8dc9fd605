"""TRL-style per-token log-probs and entropies of a HuggingFace causal LM, without logits.

    from torch_fce.integrations import transformers as fce_hf, trl as fce_trl
    fce_hf.apply(model)      # checks that the family's logits can be reproduced
    logps, entropies = fce_trl.per_token_logps_and_entropies(
        model, input_ids, attention_mask, logits_to_keep, temperature=0.7,
        compute_entropy=True)

The values TRL's helpers compute from `logits[:, -logits_to_keep - 1:-1] / temperature`
(`selective_log_softmax`, `entropy_from_logits`), from the head's input and weight
through torch_fce.linear_logprobs. docs/rl.md shows the GRPOTrainer override that uses
it.
"""

from ..functional import linear_logprobs
from .transformers import _ORIGINAL, capture_of, head_operands


def _patched(model):
    """The module apply() patched, under wrappers such as DistributedDataParallel."""
    inner = model
    while not hasattr(inner, _ORIGINAL) and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, _ORIGINAL):
        raise ValueError("per_token_logps_and_entropies needs a model patched by "
                         "torch_fce.integrations.transformers.apply(model) first")
    return inner


def per_token_logps_and_entropies(model, input_ids, attention_mask=None, logits_to_keep=None,
                                  *, temperature=1.0, compute_entropy=False,
                                  accumulator="fp32", **model_kwargs):
    """(logps, entropies) each (B, K) for the last K = logits_to_keep tokens of input_ids
    (all but the first when None); entropies is None unless compute_entropy.

    model: patched by torch_fce.integrations.transformers.apply (its check refuses
    families whose logits are not softcap(scale * lm_head(hidden))), possibly wrapped
    (DistributedDataParallel: it is called through the wrapper, so its gradient
    synchronisation runs). temperature: a float or a tensor broadcastable to (B, K).
    """
    inner = _patched(model)
    K = input_ids.shape[1] - 1 if logits_to_keep is None else int(logits_to_keep)
    if not 0 < K < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {K}")
    head = inner.get_output_embeddings()
    # Without labels the patched forward is the model's own; the head, capturing, hands
    # back its input instead of the logits.
    with capture_of(head).capturing() as capture:
        model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden, capture.hidden = capture.hidden, None
    # position t predicts token t + 1
    hidden, bias, softcap = head_operands(inner, head, hidden[:, -K - 1:-1])
    out = linear_logprobs(hidden, head.weight, input_ids[:, -K:].to(hidden.device), bias,
                          temperature=temperature, softcap=softcap, entropy=compute_entropy,
                          accumulator=accumulator)
    return out.logprob, out.entropy

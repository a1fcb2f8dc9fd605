"""TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) with torch_fce's log-probs:
the drop-in for trl.kernels.ChunkedLogProbFunction, the fused_lm_head() context that
swaps it in, and per_token_logps_and_entropies for code of your own."""

import contextlib
import warnings

import torch

from ...extension import autocast_operands, check_options
from ...functional import linear_logprobs
from .common import _head_inputs


def per_token_logps_and_entropies(model, input_ids, attention_mask=None, logits_to_keep=None,
                                  *, temperature=1.0, compute_entropy=False,
                                  accumulator="fp32", **model_kwargs):
    """(logps, entropies) each (B, K) for the last K = logits_to_keep tokens of input_ids
    (all but the first when None); entropies is None unless compute_entropy.

    The values TRL's helpers compute from `logits[:, -logits_to_keep - 1:-1] /
    temperature` (`selective_log_softmax`, `entropy_from_logits`). model: prepared by
    torch_fce.integrations.transformers.apply or attach (their check refuses families
    whose logits are not softcap(scale * lm_head(hidden))), possibly wrapped
    (DistributedDataParallel: it is called through the wrapper, so its gradient
    synchronisation runs). temperature: a float or a tensor broadcastable to (B, K).
    """
    K = input_ids.shape[1] - 1 if logits_to_keep is None else int(logits_to_keep)
    if not 0 < K < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}], got {K}")
    hidden, weight, bias, softcap, _ = _head_inputs(
        model, K, input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    out = linear_logprobs(hidden, weight, input_ids[:, -K:].to(hidden.device), bias,
                          temperature=temperature, softcap=softcap, entropy=compute_entropy,
                          accumulator=accumulator)
    return out.logprob, out.entropy


_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class ChunkedLogProbFunction:
    """A drop-in for `trl.kernels.ChunkedLogProbFunction`: the same `apply` arguments
    and outputs (log-probs and, as asked in `outputs`, entropy, log(sum_v p_v^2), the
    mean logit and whether the target is the most likely class), from
    torch_fce.linear_logprobs. log_sum_sq_probs costs two more forward sweeps (no
    gradient): log s(2z) - 2 log s(z) of the temperature-scaled logits z, s(x) =
    sum_v exp(x_v - max x) (relative to the row max, as TRL's kernel).
    mean_logits is exact: h . (sum_v w_v) for a linear head; with a softcap one more
    forward sweep of the logits (no gradient). Refused (ValueError): a DeepSpeed ZeRO-3
    weight (gathered only while TRL's head runs, so not there for the gradients this
    forms)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size=None,
              final_logit_softcapping=None, logit_scale=1.0, outputs=_OPTIONAL_OUTPUTS,
              accumulator="fp32"):
        unknown = set(outputs) - {"log_probs", *_OPTIONAL_OUTPUTS}
        if unknown:
            raise ValueError(f"outputs must be among {('log_probs',) + _OPTIONAL_OUTPUTS}, "
                             f"got {sorted(unknown)}")
        why = _unserved(weight)
        if why:
            raise ValueError(f"torch_fce does not serve {why}")
        # TRL computes in autocast's dtype: cast before the logit scale, as it does
        hidden, weight, bias = autocast_operands(hidden, weight, bias)
        if logit_scale != 1.0:  # softcap(scale * (h W^T + b)) = softcap((scale h) W^T + scale b)
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        out = linear_logprobs(hidden, weight, targets, bias, temperature=temperature,
                              softcap=final_logit_softcapping, entropy="entropy" in outputs,
                              accumulator=accumulator)
        sq = mean = None
        with torch.no_grad():
            if "log_sum_sq_probs" in outputs:
                # log sum_v p_v^2 = log s(2z) - 2 log s(z), the sums relative to the row
                # max: the log-prob of the most likely class is exactly -log s (as TRL's
                # kernel, no rounded lse cancels against another)
                def top(t):  # the most likely class's log-prob at t: -log s(z / t)
                    return linear_logprobs(hidden, weight, out.argmax, bias, temperature=t,
                                           softcap=final_logit_softcapping).logprob

                sq = 2 * top(temperature) - top(temperature / 2)
            if "mean_logits" in outputs:  # mean_v softcap(scale (h . w_v + b_v)) / T
                mean = _mean_logits(hidden, weight, bias, final_logit_softcapping,
                                    out.lse.dtype) / temperature
        top1 = out.argmax == targets if "is_top1" in outputs else None
        return out.logprob, out.entropy, sq, mean, top1


def _mean_logits(hidden, weight, bias, softcap, dtype):
    """Each row's mean logit over the classes, softcapped, in dtype (float32): without a
    softcap the mean of a linear map, h . mean_v w_v (one GEMV); with one, the logits
    themselves in chunks of at most 2^22, as the loop's workspace."""
    with torch.autocast(hidden.device.type, enabled=False):
        V = weight.shape[0]
        if softcap is None:
            mean = hidden.to(dtype) @ weight.sum(0, dtype=dtype)
            return (mean if bias is None else mean + bias.sum(dtype=dtype)) / V
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        step = max(1, 2 ** 22 // V)
        mean = torch.cat([
            (softcap * torch.tanh(torch.nn.functional.linear(flat_h[s:s + step], w, b)
                                  .to(dtype) / softcap)).mean(-1)
            for s in range(0, flat_h.shape[0], step)]) if flat_h.shape[0] else \
            flat_h.new_empty(0, dtype=dtype)
        return mean.reshape(hidden.shape[:-1])


def _unserved(weight):
    """What of a fused-head call the drop-in cannot serve exactly, or None."""
    if hasattr(weight, "ds_id"):
        return "a DeepSpeed ZeRO-3 weight (gathered only while TRL's head runs)"
    return None


@contextlib.contextmanager
def fused_lm_head(accumulator="fp32"):
    """While active, every fused LM head TRL adds (`add_fused_lm_head`: GRPO, RLOO, SFT,
    KTO, ...) computes its log-probs with torch_fce instead of TRL's kernel (process-
    wide: it swaps the function TRL's head calls, and puts TRL's back on exit); a call
    the drop-in does not serve runs TRL's kernel, with a warning."""
    import trl.trainer.utils as trl_utils

    check_options("linear_logprobs", accumulator=accumulator)
    theirs = trl_utils._ChunkedLogProbFunction

    class _Ours:
        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None,
                  logit_scale=1.0, outputs=_OPTIONAL_OUTPUTS):
            args = (hidden, weight, bias, targets, temperature, chunk_size, softcap,
                    logit_scale, outputs)
            why = _unserved(weight)
            if why:
                warnings.warn(f"torch_fce.integrations.trl.fused_lm_head: TRL's kernel "
                              f"serves this call: torch_fce does not serve {why}",
                              stacklevel=2)
                return theirs.apply(*args)
            return ChunkedLogProbFunction.apply(*args, accumulator=accumulator)

    trl_utils._ChunkedLogProbFunction = _Ours
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = theirs

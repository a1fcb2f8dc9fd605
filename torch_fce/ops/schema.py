"""Every fce:: schema in one place.

`linear_ce` and `linear_logprobs` are the public ops (docs/api.md). Each is
CompositeImplicitAutograd: under
autograd and tracing it decomposes into the two internal ops below, which carry the
fake kernels, the per-device kernels and the autograd formula. That split is what lets
the forward compute the gradients (3 matmuls instead of 4) when the loss is a scalar,
while `torch.ops.fce.linear_ce` itself stays one node in pre-grad graphs.
"""

import torch

LIB = torch.library.Library("fce", "DEF")


LIB.define(
    "linear_ce(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
    "Tensor? class_weight=None, *, SymInt ignore_index=-100, str reduction=\"mean\", "
    "float label_smoothing=0.0, float? softcap=None, float z_loss=0.0, "
    "str accumulator=\"fp32\") -> Tensor"
)

# hidden (N, D), target (N,). Returns the loss (() or (N,)) and, for the inputs flagged
# in needs_grad, the gradients of the loss with unit upstream gradient ((0,) otherwise;
# requested only for reduction "mean"/"sum"). grad_weight and grad_bias are float32 with the
# "fp32" accumulator (rounded once, in the backward; float64 for float64 weights and bias),
# else in the weight's and the bias's dtypes. With stats, also each token's lse and
# argmax (the token statistics of linear_ce_stats; (0,) otherwise).
LIB.define(
    "linear_ce_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
    "Tensor? class_weight, SymInt ignore_index, str reduction, float label_smoothing, "
    "float? softcap, float z_loss, str accumulator, bool[3] needs_grad, bool stats) "
    "-> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, "
    "Tensor lse, Tensor argmax)"
)

# linear_ce with the token statistics of the same pass: lse and argmax, target.shape.
LIB.define(
    "linear_ce_stats(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
    "Tensor? class_weight=None, *, SymInt ignore_index=-100, str reduction=\"mean\", "
    "float label_smoothing=0.0, float? softcap=None, float z_loss=0.0, "
    "str accumulator=\"fp32\") -> (Tensor loss, Tensor lse, Tensor argmax)"
)

# Gradients for the upstream gradient grad_loss of the loss (() or (N,) as the loss),
# recomputing the logits.
LIB.define(
    "linear_ce_bwd(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor target, "
    "Tensor? bias, Tensor? class_weight, SymInt ignore_index, str reduction, "
    "float label_smoothing, "
    "float? softcap, float z_loss, str accumulator, bool[3] needs_grad) "
    "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)"
)

# grad * scale rounded once to dtype (the backward of a loss whose gradients the forward
# computed); scale is the 0-d upstream gradient.
LIB.define("scale_grad(Tensor grad, Tensor scale, ScalarType dtype) -> Tensor")


# Per-token log-probs (docs/rl.md): the log-softmax of softcap(logits) / temperature at
# target, its entropy, logsumexp and argmax, each target.shape (entropy (0,) unless
# entropy=True). temperature: None (1) or target.shape.
LIB.define(
    "linear_logprobs(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
    "Tensor? temperature=None, *, float? softcap=None, SymInt ignore_index=-100, "
    "bool entropy=False, str accumulator=\"fp32\") "
    "-> (Tensor logprob, Tensor entropy, Tensor lse, Tensor argmax)"
)

# hidden (N, D), target and temperature (N,). The forward forms no gradient: every output
# is per token, so the backward recomputes the logits with the upstream gradients
# (accumulator is for the backward's weight-gradient sum).
LIB.define(
    "linear_logprobs_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
    "Tensor? temperature, float? softcap, SymInt ignore_index, bool entropy, "
    "str accumulator) -> (Tensor logprob, Tensor entropy, Tensor lse, Tensor argmax, "
    "Tensor row_stats)"
)

# row_stats (N, 3) are the forward's per-token statistics, relative to the row's max m
# of z: (m, log sum_c exp(z_c - m), sum_c p_c (z_c - m)) (the last 0 unless entropy).
# The backward recomputes the logits but not these, and forms p_c and z_c - mu from
# z_c - m, which is exact near the max: lse alone would lose 1 - p on confident rows.
LIB.define(
    "linear_logprobs_bwd(Tensor grad_logprob, Tensor? grad_entropy, Tensor row_stats, "
    "Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? temperature, "
    "float? softcap, SymInt ignore_index, str accumulator, bool[3] needs_grad) "
    "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)"
)


# The per-token policy loss of RL training (docs/rl.md): sum over the tokens not ignored
# of token_weights * (policy term + beta * KL (times the ratio with kl_ratio) -
# entropy_coef * entropy), with the per-token statistics (logprob, entropy, ratio,
# clipped, kl), each target.shape.
LIB.define(
    "linear_policy_loss(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, "
    "Tensor? bias=None, Tensor? old_logprobs=None, Tensor? ref_logprobs=None, "
    "Tensor? token_weights=None, Tensor? temperature=None, *, str loss_type=\"clip\", "
    "float epsilon_low=0.2, float? epsilon_high=None, float? delta=None, "
    "float sapo_temperature_pos=1.0, float sapo_temperature_neg=1.05, float beta=0.0, "
    "str kl=\"k3\", bool kl_ratio=False, float entropy_coef=0.0, float? softcap=None, "
    "SymInt ignore_index=-100, str accumulator=\"fp32\") -> (Tensor loss, Tensor logprob, "
    "Tensor entropy, Tensor ratio, Tensor clipped, Tensor kl)"
)

# hidden (N, D), the per-token tensors (N,). The loss is a scalar, so the forward forms
# the gradients for a unit upstream gradient (3 GEMMs), as linear_ce_fwd does.
LIB.define(
    "linear_policy_loss_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor advantages, "
    "Tensor? bias, Tensor? old_logprobs, Tensor? ref_logprobs, Tensor? token_weights, "
    "Tensor? temperature, str loss_type, float epsilon_low, float? epsilon_high, "
    "float? delta, float sapo_temperature_pos, float sapo_temperature_neg, float beta, "
    "str kl, bool kl_ratio, float entropy_coef, float? softcap, SymInt ignore_index, "
    "str accumulator, bool[3] needs_grad) -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, "
    "Tensor grad_bias, Tensor logprob, Tensor entropy, Tensor ratio, Tensor clipped, "
    "Tensor kl)"
)


"""Each op's options are one record: the schemas are written from it, every internal
call spreads it, and bad values are refused naming the option, in one place."""

import pytest
import torch

from torch_fce.ops.loop.chunked import ONE_DEVICE, VocabShard
from torch_fce.ops.linear_ce import CEOptions
from torch_fce.ops.linear_logprobs import LogProbOptions
from torch_fce.ops.linear_policy_loss import PolicyOptions
from torch_fce.ops.contract.options import take

# op -> (record, the tensor arguments before it, what follows the shard)
OPS = {
    "linear_ce_fwd": (CEOptions, 5, ["needs_grad", "stats"]),
    "linear_ce_bwd": (CEOptions, 6, ["needs_grad"]),
    "linear_logprobs_fwd": (LogProbOptions, 5, []),
    "linear_logprobs_bwd": (LogProbOptions, 8, ["needs_grad"]),
    "linear_policy_loss_fwd": (PolicyOptions, 9, ["needs_grad"]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_internal_schemas_are_the_record_then_the_shard(name):
    record, before, after = OPS[name]
    args = [a.name for a in getattr(torch.ops.fce, name).default._schema.arguments]
    assert args[before:] == [*record._fields, *VocabShard._fields, *after]


@pytest.mark.parametrize("public, record", [("linear_ce", CEOptions),
                                            ("linear_logprobs", LogProbOptions),
                                            ("linear_policy_loss", PolicyOptions)])
def test_public_schemas_take_the_record_by_keyword_with_its_defaults(public, record):
    schema = getattr(torch.ops.fce, public).default._schema
    kw = {a.name: a.default_value for a in schema.arguments if a.kwarg_only}
    assert list(kw) == list(record._fields) and kw == record()._asdict()


def test_take_reads_back_a_spread_record():
    opts = PolicyOptions(loss_type="sapo", beta=0.1, ignore_index=7)
    got, rest = take(PolicyOptions, (*opts, *ONE_DEVICE, [True] * 3))
    assert got == opts and take(VocabShard, rest) == (ONE_DEVICE, ([True] * 3,))


@pytest.mark.parametrize("opts, name", [
    (CEOptions(reduction="avg"), "reduction"), (CEOptions(label_smoothing=2.0),
                                                "label_smoothing"),
    (CEOptions(softcap=0.0), "softcap"), (CEOptions(z_loss=-1.0), "z_loss"),
    (CEOptions(accumulator="bf16"), "accumulator"), (CEOptions(ignore_index=1.5),
                                                     "ignore_index"),
    (LogProbOptions(entropy=1), "entropy"), (PolicyOptions(loss_type="ppo"), "loss_type"),
    (PolicyOptions(kl="k4"), "kl"), (PolicyOptions(epsilon_high=-0.1), "epsilon_high"),
    (PolicyOptions(delta=0.0), "delta"), (PolicyOptions(sapo_temperature_neg=0.0),
                                          "sapo_temperature_neg"),
    (PolicyOptions(beta=float("nan")), "beta"),
    (PolicyOptions(entropy_coef=float("inf")), "entropy_coef")])
def test_records_refuse_bad_values_naming_the_option(opts, name):
    with pytest.raises((TypeError, ValueError), match=name):
        opts.check()


def test_policy_record_resolves_epsilon_high():
    assert PolicyOptions(epsilon_low=0.3).check().epsilon_high == 0.3
    assert PolicyOptions(epsilon_low=0.3, epsilon_high=0.28).check().epsilon_high == 0.28

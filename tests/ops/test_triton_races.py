"""The row kernels that write over what they read, under the interpreter's race checker
(tests/races.py): no thread reads or writes what another thread of its program wrote or
read since the last barrier, and no program touches another's bytes. The interpreter
itself runs a program's operations in order, so these races pass every other CPU test.
The sparse divergence's kernel (its tail's support logits marked in the row, its
scratch reused, dz over the float32 logits), a vocabulary shard's two kernels, the
sparse gradient's products, the cross entropy's and the divergence's in-place dz
after their target's logit, and the log-probs' threshold kernel's scratch."""

import tempfile

import pytest
import torch
import torch.distributed as dist

from torch_fce.ops import linear_ce, linear_distillation, linear_sparse_divergence as room
from torch_fce.ops.loop.chunked import ONE_DEVICE, VocabShard

from tests.helpers import DEVICE, TRITON, chunks, dz_over_inputs
from tests.races import races

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter's")


def _support(g, N, V, K):
    support = torch.randint(0, V, (N, K), generator=g)
    support[:, -1] = support[:, 0]  # a class named twice
    support[1, 1] = -100  # an invalid entry
    support[2] = -100  # a token without valid entries
    lp = torch.randn(N, K, generator=g).log_softmax(-1) - 0.1
    lp[3, 2] = float("-inf")
    return support, lp


@pytest.mark.parametrize("tail, beta, softcap", [(True, 0.0, None), (True, 0.5, 3.0),
                                                  (False, 1.0, 3.0)])
def test_sparse_divergence(tail, beta, softcap):
    # with the tail, 16-bit dz over float32 logits across three 4096-class blocks;
    # without it no dz, the products' scatter (a program a class: 600 of them)
    h, w, _, g = dz_over_inputs(torch.bfloat16, 4)
    w = w if tail else w[:600]
    support, lp = _support(g, h.shape[0], w.shape[0], 4)
    rec = room.SparseDivOptions(beta=beta, tail=tail, softcap=softcap,
                                logits_dtype=torch.float32)
    with chunks(3, h, w), races() as flags:
        room.fwd(h, w, support, lp, None, None, torch.full((h.shape[0],), 0.8), *rec,
                 *ONE_DEVICE, [True, True, False], backend=TRITON)
    assert not flags, flags


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    yield VocabShard(dist.group.WORLD.group_name, 0, 600, 1)
    dist.destroy_process_group()


@pytest.mark.parametrize("tail", [True, False])
def test_a_shards_sparse_divergence(one_rank_group, tail):
    # the sums kernel, then the row kernel from the all-reduced sums (FROM_PART)
    g = torch.Generator().manual_seed(4)
    N, D, V, K = 5, 8, 600, 4
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    support, lp = _support(g, N, V, K)
    rec = room.SparseDivOptions(beta=0.5, tail=tail, logits_dtype=torch.float32)
    with chunks(3, h, w), races() as flags:
        room.fwd(h, w, support, lp, None, None, torch.ones(N), *rec, *one_rank_group,
                 [True, True, False], backend=TRITON)
    assert not flags, flags


def test_cross_entropy_and_divergence_read_their_target_before_dz():
    g = torch.Generator().manual_seed(2)
    N, D, V = 4, 8, 300
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    ht, wt = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    with races() as flags:
        linear_ce.fwd(h, w, y, None, None, *linear_ce.CEOptions(), *ONE_DEVICE,
                      [True, True, False], False, backend=TRITON)
        linear_distillation.fwd(
            h, w, ht, wt, y, None, None, None, torch.ones(N),
            *linear_distillation.DistillOptions(hard_weight=0.5, logits_dtype=None),
            *ONE_DEVICE, [True, True, False], backend=TRITON)
    assert not flags, flags


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_p=0.5, min_p=0.02)])
def test_threshold_kernel_scratch(truncation):
    # top_p without a top-k: a sweep of the row writes the bracket's keys to the scratch,
    # the next sweeps read them, then the C slots (scratch and slots small: every row
    # through both)
    from torch_fce.ops.linear_logprobs import LogProbOptions
    from torch_fce.ops.linear_logprobs.truncation_kernels import triton_threshold_stats

    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 1500, generator=g) * torch.tensor([0.5, 2.0, 4.0])[:, None]
    opts = LogProbOptions(entropy=True, **truncation)
    with races() as flags:
        triton_threshold_stats(z, torch.zeros(3, dtype=torch.int64), torch.ones(3), opts,
                               torch.float32, slots=8, cap=256)
    assert not flags, flags

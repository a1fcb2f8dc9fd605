"""The logits workspace: the CUDA default's rule (checked on any machine, with the GPU's
memory size stubbed), set_workspace / workspace, the environment variable, and every
op's forward and backward held to it."""

import math
import types

import pytest
import torch

import torch_fce
from torch_fce.ops.loop import workspace

from tests.helpers import DEVICE


@pytest.fixture
def h200(monkeypatch):
    props = types.SimpleNamespace(total_memory=143_771_000_000)  # an H200's 139 GiB
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


@pytest.mark.parametrize("N,V,D,dtype,rows", [
    # twice the head's bytes, capped at half the logits (the benchmark shapes A, B, C)
    (16384, 128256, 4096, torch.bfloat16, 8192),
    (8192, 256000, 2304, torch.bfloat16, 4096),
    (32768, 151936, 4096, torch.bfloat16, 8192),
    # a small head: at least 4096 rows (below 1 GiB), in either dtype
    (32768, 32768, 1024, torch.bfloat16, 4096),
    (32768, 32768, 1024, torch.float32, 4096),
    # a wide vocabulary with a narrow head: at least 1 GiB (below 4096 rows)
    (65536, 262144, 256, torch.bfloat16, 2048),
    # the 4 GiB cap
    (65536, 131072, 16384, torch.bfloat16, 16384),
    # few tokens: half of them, then whole GEMM tiles
    (1000, 32768, 1024, torch.bfloat16, 384),
])
def test_cuda_default_rows(h200, N, V, D, dtype, rows):
    assert workspace._nbytes is None
    assert workspace.chunk_rows(N, V, D, dtype, "cuda") == rows


@pytest.mark.parametrize("D,rows", [(4096, 1664), (1536, 1664), (256, 1664)])
def test_cuda_default_without_a_weight_gradient_is_the_floor(h200, D, rows):
    # the top-k's float32 logits (4 bytes a logit, V = 151936): 1 GiB whatever the head
    # (1766 rows, balanced over 10 chunks of whole tiles), not twice a 4096-wide head
    assert workspace.chunk_rows(16384, 151936, D, torch.bfloat16, "cuda", per_logit=4,
                                weight_grad=False) == rows
    assert workspace.chunk_rows(16384, 151936, 4096, torch.bfloat16, "cuda",
                                per_logit=4) == 4096


def test_topk_default_holds_its_chunk_in_a_tenth(h200):
    # the teacher's top-k, float32 logits (V = 151936, 16384 tokens): the op's default
    # (1.25 times the floor, whatever the head) cuts 8 chunks, each within 1/10 of the
    # compiled unfused composition's 14240 MiB (docs/distillation.md)
    from torch_fce.ops import linear_topk_logprobs as room

    for D in (1536, 4096):
        rows = workspace.chunk_rows(16384, 151936, D, torch.bfloat16, "cuda", per_logit=4,
                                    scale=room._WORKSPACE_SCALE, weight_grad=False)
        assert rows == 2048 and rows * 151936 * 4 / 2**20 <= 14240 / 10


def test_sparse_divergence_default_holds_its_chunk_and_sum_in_a_tenth(h200):
    # bf16 inputs, float32 logits (V = 151936, D = 1024, 16384 tokens): the Triton rows
    # write dz over the logits (4 bytes a logit; the PyTorch rows' dz has its own 2, beside
    # three float32 temporaries, the tail's sum off the support among them), and the
    # op's default chunk (3/4 of the loop's) with the float32 weight-gradient sum stays
    # within 1/10 of the compiled TRL composition's 14250 MiB (docs/distillation.md)
    from torch_fce.ops import linear_sparse_divergence as room
    from torch_fce.ops.linear_sparse_divergence import kernels, rows as torch_rows

    per_logit = kernels.ROWS.per_logit(torch.float32, torch.bfloat16)
    assert per_logit == 4
    assert torch_rows.ROWS.per_logit(torch.float32, torch.bfloat16) == 6 + 3 * 4
    N, V, D = 16384, 151936, 1024
    rows = workspace.chunk_rows(N, V, D, torch.bfloat16, "cuda", per_logit=per_logit,
                                scale=room._WORKSPACE_SCALE)
    assert rows == 1280  # 13 chunks
    assert (rows * V * per_logit + 4 * V * D) / 2**20 <= 14250 / 10


@pytest.mark.parametrize("V,rows", [(64, (1 << 22) // 64), (16384, 256), (32000, 256),
                                    (262144, 256)])
def test_other_device_default_rows(V, rows):
    # 2^22 logits, or 256 rows where that is more (no half-the-logits cap here)
    assert workspace.chunk_rows(3 * rows, V, 8, torch.float32, "cpu") == rows


@pytest.mark.parametrize("N,V,D,device,rows", [
    # bench sft's head: the default's 3456 rows need 5 chunks: 5 of 3328 (whole tiles)
    (16384, 151936, 1536, "cuda", 3328),
    (15360, 151936, 1536, "cuda", 3072),
    (1000, 16384, 8, "cpu", 250),  # 256 rows need 4 chunks: 4 of 250
    (7, 16384, 8, "cpu", 7),  # one chunk of every token
])
def test_chunks_are_balanced(h200, N, V, D, device, rows):
    # as many chunks as the workspace needs, of equal rows: no thin last chunk
    assert workspace.chunk_rows(N, V, D, torch.bfloat16, device) == rows


def test_set_workspace_replaces_the_default_and_is_restored(h200):
    with torch_fce.workspace(256 << 20):
        assert workspace.chunk_rows(16384, 128256, 4096, torch.bfloat16, "cuda") == 1024
        assert workspace.chunk_rows(1 << 20, 64, 8, torch.float32, "cpu") == 1 << 20
    assert workspace.chunk_rows(16384, 128256, 4096, torch.bfloat16, "cuda") == 8192
    assert workspace.chunk_rows(1 << 20, 64, 8, torch.float32, "cpu") == (1 << 22) // 64


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GB"])
def test_set_workspace_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="nbytes"):
        torch_fce.set_workspace(bad)


@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "big"])
def test_workspace_environment_variable_is_validated(monkeypatch, bad):
    monkeypatch.setenv("TORCH_FCE_WORKSPACE_MB", bad)
    with pytest.raises(ValueError, match="TORCH_FCE_WORKSPACE_MB"):
        workspace._from_env()


# The benchmark shapes' small heads (D, Q1024, E, Q2048) and A, bf16, 16384 tokens.
LOG_PROB_SHAPES = [(896, 151936), (1024, 151936), (1536, 151936), (2048, 151936),
                   (4096, 128256)]


@pytest.mark.parametrize("D,V", LOG_PROB_SHAPES)
@pytest.mark.parametrize("tiles", [False, True])
def test_log_prob_family_default_within_a_float32_weight_sum_and_a_tile(h200, D, V, tiles):
    # The op's peak, its chunk plus the float32 sums it keeps beyond its gradients (token
    # chunks: the weight-gradient sum's excess over the bf16 gradient; tiles: the hidden
    # gradient's), within a float32 weight-gradient sum plus 256 MiB, as a
    # vocabulary-tiled head holds; as few chunks as the largest whole GEMM tiles that fit.
    N = 16384
    held = (N if tiles else V) * D * 2
    rows = workspace.chunk_rows(N, V, D, torch.bfloat16, "cuda", held=held)
    bound = 4 * V * D + (256 << 20)
    fit = (bound - held) // (V * 2) // 128 * 128
    default = workspace.chunk_rows(N, V, D, torch.bfloat16, "cuda")
    assert rows * V * 2 + held <= bound and rows == _balanced(N, fit) or rows == default
    assert rows <= default
    if not tiles:  # the cross-entropy's default would exceed the bound on every shape here
        assert rows < default
    with torch_fce.workspace(256 << 20):  # a set workspace is taken as it is, balanced
        fit = (256 << 20) // (V * 2) // 128 * 128
        assert workspace.chunk_rows(N, V, D, torch.bfloat16, "cuda", held=held) == \
            _balanced(N, fit)


def _balanced(N, fit):
    """The rows of as few chunks as fit-row ones (whole 128-row tiles), all of one size."""
    chunks = -(-N // fit)
    return -(-(-(-N // chunks)) // 128) * 128


def test_head_bound_bounds_the_cross_entropy_as_the_log_prob_family(monkeypatch):
    # the cross entropy's chunks with head_bound=True: the family's rule for token chunks
    from torch_fce.ops import linear_ce

    asked = []
    rows_for = linear_ce.chunk_rows_for
    monkeypatch.setattr(linear_ce, "chunk_rows_for",
                        lambda *a, **k: asked.append(k.get("log_prob_tiles")) or rows_for(*a, **k))
    h, w, y = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    want = torch_fce.linear_cross_entropy(h, w, y)
    got = torch_fce.linear_cross_entropy(h, w, y, head_bound=True)
    assert asked == [None, False]
    assert torch_fce.linear_cross_entropy(h, w, y) is not None and asked[-1] is None
    assert torch.equal(got, want)


def _largest_input(run):
    """The most elements of any tensor an aten op took while run() ran (torch's
    profiler sees the ops inside the custom ops too; each op's output is the input of
    the next one that reads it). Its raw events: the FunctionEvent tree took minutes."""
    with torch.profiler.profile(record_shapes=True,
                                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return max((math.prod(shape) for event in prof.profiler.kineto_results.events()
                if event.name().startswith("aten::") for shape in event.shapes() if shape),
               default=0)


def _every_op(h, w, t, sup, lp, ht, wt):
    """Each public op's forward and backward on these inputs."""
    A = torch.ones(t.shape, device=DEVICE)
    return {
        "cross entropy": lambda: torch_fce.linear_cross_entropy(h, w, t),
        "log-probs": lambda: torch_fce.linear_logprobs(h, w, t, entropy=True).logprob.sum(),
        "log-probs, top_p": lambda: torch_fce.linear_logprobs(h, w, t, top_p=0.9).logprob
        .nan_to_num(neginf=0.0).sum(),
        "policy loss": lambda: torch_fce.linear_policy_loss(h, w, t, A, beta=0.0)[0],
        "distillation": lambda: torch_fce.linear_distillation_loss(h, w, ht, wt, t)[0],
        "soft cross entropy": lambda: torch_fce.linear_soft_cross_entropy(
            h, w, sup, lp.exp()),
        "sparse divergence": lambda: torch_fce.linear_sparse_divergence(h, w, sup, lp,
                                                                       tail=True)[0],
        "top-k": lambda: torch_fce.linear_topk_logprobs(h, w, 8, target=t).logprobs.sum(),
    }


def test_every_op_holds_the_workspace_forward_and_backward():
    # The N x V logits are never formed whole: with fewer tokens than classes (the
    # log-probs' vocabulary tiles) and a workspace of 128 rows, no tensor an aten op sees
    # is larger than the workspace's logits or the smallest unit the loop cuts (off
    # CUDA a 256 x 4096 GEMM unit; on CUDA 128 rows of the vocabulary); the whole
    # logits are 4x that unit.
    from torch_fce.ops.loop.chunked import CUDA_MIN_ROWS, UNIT_COLS, UNIT_ROWS

    N, D, V = 1024, 8, 4096
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    h = torch.randn(N, D, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) / 4).to(DEVICE, dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    sup = torch.randint(0, V, (N, 4), generator=g).to(DEVICE)
    lp = torch.randn(N, 4, generator=g).log_softmax(-1).to(DEVICE)
    ht, wt = torch.randn(N, D, generator=g).to(DEVICE, dtype), w.detach().clone()
    nbytes = 128 * V * 4
    unit = CUDA_MIN_ROWS * V if DEVICE == "cuda" else UNIT_ROWS * min(V, UNIT_COLS)
    bound = max(unit, nbytes // torch.finfo(dtype).bits * 8)
    assert N * V >= 4 * bound
    for name, loss in _every_op(h, w, t, sup, lp, ht, wt).items():
        grads = []

        def run():
            with torch_fce.workspace(nbytes):
                out = loss()
                if out.requires_grad:  # the top-k has no gradient
                    grads.extend(torch.autograd.grad(out, [h, w], allow_unused=True))

        largest = _largest_input(run)
        assert largest <= bound, (name, largest, bound)
        assert all(g is None or g.isfinite().all() for g in grads), name

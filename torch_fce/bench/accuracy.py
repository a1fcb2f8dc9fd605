"""The accuracy study: each method's loss and gradient errors against float64 from the
same bf16 inputs, as the number of tokens grows."""

import dataclasses
import sys

import torch
import torch.nn.functional as F

from torch_fce.bench.peers import reference, run_step
from torch_fce.testing import make_inputs, rel_err


@dataclasses.dataclass(frozen=True)
class AccuracyResult:
    N: int
    D: int
    V: int
    method: str
    loss_err: float
    dE_err: float
    dW_err: float
    loss_api_err: float


def accuracy(fns, device, Ns, D=256, V=2048, progress=print):
    """Errors against a float64 reference from the same bf16 inputs, as N grows."""
    rows = []
    for N in Ns:
        x = make_inputs(N, D, V, torch.bfloat16, device=device, weight_scale=2.0)
        ref = reference(x, torch.float64)
        # docs/api.md's formula rounds the logits to the input dtype before the float32 math.
        api_loss = F.cross_entropy(F.linear(x["hidden"], x["weight"]).double(), x["target"],
                                   ignore_index=-100)
        for name, fn in fns.items():
            progress(f"accuracy N={N} {name}")
            try:
                out = run_step(fn, x)
            except Exception as e:
                print(f"  {name} failed at N={N}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            errs = [rel_err(a, b) for a, b in zip(out, ref)]
            rows.append(AccuracyResult(N, D, V, name, *errs, rel_err(out[0], api_loss)))
    return rows


def print_accuracy(rows):
    print(f"{'N':>7} {'method':14} {'loss err':>9} {'dE err':>8} {'dW err':>8} "
          f"{'loss err vs API formula':>24}")
    for r in rows:
        print(f"{r.N:7d} {r.method:14} {r.loss_err:9.2e} {r.dE_err:8.2e} {r.dW_err:8.2e} "
              f"{r.loss_api_err:24.2e}")

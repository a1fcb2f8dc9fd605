"""LinearCrossEntropyLoss: the nn.Module form of torch_fce.linear_cross_entropy."""

from torch import nn

from .functional import linear_cross_entropy
from .ops.linear_ce import CEOptions


class LinearCrossEntropyLoss(nn.Module):
    """Fused linear + cross-entropy loss; options as torch_fce.linear_cross_entropy.

    forward(hidden (*, D), weight (V, D), target (*), bias=None) -> loss.
    """

    def __init__(self, *, class_weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, softcap=None, z_loss=0.0, accumulator="fp32",
                 shift=False, logits_dtype=None, dft=False):
        super().__init__()
        CEOptions(ignore_index, reduction, label_smoothing, softcap, z_loss, accumulator,
                  logits_dtype, dft).check()
        self.register_buffer("class_weight", class_weight)
        self.options = dict(ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                            accumulator=accumulator, shift=shift, logits_dtype=logits_dtype,
                            dft=dft)

    def forward(self, hidden, weight, target, bias=None):
        return linear_cross_entropy(hidden, weight, target, bias, self.class_weight,
                                    **self.options)

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())

"""LinearCrossEntropyLoss: the nn.Module form of torch_fce.linear_cross_entropy."""

from torch import nn

from .functional import linear_cross_entropy
from .ops.linear_ce import CEOptions

_CE = CEOptions()  # the defaults, as linear_cross_entropy's


class LinearCrossEntropyLoss(nn.Module):
    """Fused linear + cross-entropy loss; options as torch_fce.linear_cross_entropy.

    forward(hidden (*, D), weight (V, D), target (*), bias=None) -> loss.
    """

    def __init__(self, *, class_weight=None, ignore_index=_CE.ignore_index,
                 reduction=_CE.reduction, label_smoothing=_CE.label_smoothing,
                 softcap=_CE.softcap, z_loss=_CE.z_loss, accumulator=_CE.accumulator,
                 shift=False, logits_dtype=_CE.logits_dtype, dft=_CE.dft):
        super().__init__()
        self.opts = CEOptions(ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing, softcap=softcap,
                              z_loss=z_loss, accumulator=accumulator,
                              logits_dtype=logits_dtype, dft=dft).check()
        self.shift = shift
        self.register_buffer("class_weight", class_weight)

    def forward(self, hidden, weight, target, bias=None):
        return linear_cross_entropy(hidden, weight, target, bias, self.class_weight,
                                    shift=self.shift, **self.opts._asdict())

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in (*self.opts._asdict().items(),
                                                    ("shift", self.shift)))

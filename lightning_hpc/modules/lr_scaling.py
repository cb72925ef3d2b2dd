"""Learning-rate and weight-decay scaling with the global batch size.

``rule="linear"``: lr' = k lr (the K-FAC paper's N x 0.1 and N x 0.0125, and Krizhevsky's practical choice);
``rule="sqrt"``: lr' = sqrt(k) lr (keeps the variance of the gradient estimate constant);
``adjust_weight_decay=True``: keep the total weight-decay penalty per sample constant, one-weird-trick paper
section 5: (1 - lr wd)^k = 1 - lr' wd', so wd' = (1 - (1 - lr wd)^k) / lr'.
Here k = global batch / ``reference_batch_size`` (the batch the base hyper-parameters were tuned for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ScalingRule", "scale_factor", "scaled_lr", "adjusted_weight_decay", "scale_hparams"]

RULES = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class ScalingRule:
    rule: str = "none"
    reference_batch_size: int | None = None
    adjust_weight_decay: bool = False

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"lr_scaling.rule must be one of {RULES}, got {self.rule!r}")
        if self.rule != "none" and (self.reference_batch_size is None or self.reference_batch_size <= 0):
            raise ValueError(f"lr_scaling.rule={self.rule!r} needs a positive lr_scaling.reference_batch_size")


def scale_factor(global_batch_size: int, reference_batch_size: int) -> float:
    return global_batch_size / reference_batch_size


def scaled_lr(lr: float, k: float, rule: str) -> float:
    if rule == "linear":
        return lr * k
    if rule == "sqrt":
        return lr * math.sqrt(k)
    if rule == "none":
        return lr
    raise ValueError(f"lr_scaling.rule must be one of {RULES}, got {rule!r}")


def adjusted_weight_decay(lr: float, weight_decay: float, k: float, new_lr: float) -> float:
    """wd' with (1 - lr wd)^k = 1 - lr' wd' (one-weird-trick paper, section 5)."""
    if new_lr == 0:
        return weight_decay
    return (1.0 - (1.0 - lr * weight_decay) ** k) / new_lr


def scale_hparams(lr: float, weight_decay: float, global_batch_size: int, rule: ScalingRule) -> tuple[float, float]:
    """(lr', wd') for ``global_batch_size`` under ``rule``."""
    if rule.rule == "none":
        return lr, weight_decay
    assert rule.reference_batch_size is not None
    k = scale_factor(global_batch_size, rule.reference_batch_size)
    new_lr = scaled_lr(lr, k, rule.rule)
    new_wd = adjusted_weight_decay(lr, weight_decay, k, new_lr) if rule.adjust_weight_decay else weight_decay
    return new_lr, new_wd

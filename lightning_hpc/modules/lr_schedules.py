"""Learning-rate schedules used by the recipes, stepped per optimizer step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_multistep_factor", "warmup_multistep"]


def warmup_multistep_factor(
    step: int, steps_per_epoch: float, warmup_epochs: float, milestones: Sequence[float], gamma: float
) -> float:
    """Multiplier of the base lr at optimizer step ``step``: linear warm-up from ~0 over ``warmup_epochs``
    (Goyal et al., used by the K-FAC paper), then ``gamma`` at each milestone epoch passed."""
    epoch = step / max(steps_per_epoch, 1e-12)
    factor = gamma ** sum(1 for m in milestones if epoch >= m)
    if warmup_epochs > 0 and epoch < warmup_epochs:
        factor *= (step + 1) / (warmup_epochs * steps_per_epoch)
    return factor


def warmup_multistep(
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: float,
    warmup_epochs: float = 0.0,
    milestones: Sequence[float] = (),
    gamma: float = 0.1,
) -> LambdaLR:
    """Linear warm-up followed by step decays at epoch ``milestones``."""
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
    ms = sorted(float(m) for m in milestones)
    return LambdaLR(optimizer, lambda s: warmup_multistep_factor(s, steps_per_epoch, warmup_epochs, ms, gamma))

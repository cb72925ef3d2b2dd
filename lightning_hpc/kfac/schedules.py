"""Epoch schedules of the K-FAC hyper-parameters (paper section V-C).

Damping is multiplied by ``damping_decay_rate`` at each epoch of ``damping_decay_epochs`` ("we reduce the
damping by a fixed scalar quantity at fixed epochs"); the factor and decomposition update intervals are
multiplied by ``update_freq_decay_rate`` at each epoch of ``update_freq_decay_epochs`` (the paper's
kfac-update-freq schedule). Values are pure functions of the epoch, so a resumed run recomputes them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["KFACSchedule"]


def _passed(epoch: int, milestones: Sequence[int]) -> int:
    return sum(1 for m in milestones if epoch >= m)


@dataclass(frozen=True)
class KFACSchedule:
    """Base values and their epoch milestones."""

    damping: float
    factor_update_freq: int
    inv_update_freq: int
    damping_decay_epochs: Sequence[int] = field(default_factory=tuple)
    damping_decay_rate: float = 1.0
    update_freq_decay_epochs: Sequence[int] = field(default_factory=tuple)
    update_freq_decay_rate: float = 1.0

    def __post_init__(self) -> None:
        if not self.damping >= 0:
            raise ValueError(f"K-FAC damping must be >= 0, got {self.damping}")
        for key in ("factor_update_freq", "inv_update_freq"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"K-FAC {key} must be a positive integer (steps), got {v!r}")
        if not self.damping_decay_rate > 0:
            raise ValueError(f"K-FAC damping_decay_rate must be > 0, got {self.damping_decay_rate}")
        if not self.update_freq_decay_rate > 0:
            raise ValueError(f"K-FAC update_freq_decay_rate must be > 0, got {self.update_freq_decay_rate}")
        for key in ("damping_decay_epochs", "update_freq_decay_epochs"):
            if any(int(e) < 0 for e in getattr(self, key)):
                raise ValueError(f"K-FAC {key} must hold epochs >= 0, got {list(getattr(self, key))}")

    def damping_at(self, epoch: int) -> float:
        return self.damping * self.damping_decay_rate ** _passed(epoch, self.damping_decay_epochs)

    def _freq(self, base: int, epoch: int) -> int:
        return max(1, int(round(base * self.update_freq_decay_rate ** _passed(epoch, self.update_freq_decay_epochs))))

    def factor_update_freq_at(self, epoch: int) -> int:
        return self._freq(self.factor_update_freq, epoch)

    def inv_update_freq_at(self, epoch: int) -> int:
        return self._freq(self.inv_update_freq, epoch)

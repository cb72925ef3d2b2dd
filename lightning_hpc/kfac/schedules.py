"""Epoch schedules of the K-FAC hyper-parameters (paper section V-C).

Damping is multiplied by ``damping_decay_rate`` at each epoch of ``damping_decay_epochs`` ("we reduce the
damping by a fixed scalar quantity at fixed epochs"); the factor and decomposition update intervals are
multiplied by ``update_freq_decay_rate`` at each epoch of ``update_freq_decay_epochs`` (the paper's
kfac-update-freq schedule). Values are pure functions of the epoch, so a resumed run recomputes them exactly.

Each base value may also be a callable of the optimizer step (``damping=lambda step: ...``, as kfac-pytorch
allows): it is called with the preconditioner's step counter, checked like a constant (a bad value raises
``ValueError`` naming the option and the step), and the epoch milestones still multiply it. A resumed run
restores the step counter, so callables of the step are recomputed exactly too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KFACSchedule", "SpreadDecompositions", "spread_phases", "value_at"]


def value_at(name: str, value: Any, step: int, check: Callable[[Any], bool], need: str) -> Any:
    """``value`` (or ``value(step)`` for a callable), checked: ``ValueError`` naming the option otherwise."""
    v = value(step) if callable(value) else value
    if not check(v):
        where = f" (returned by its callable at step {step})" if callable(value) else ""
        raise ValueError(f"K-FAC {name} must be {need}, got {v!r}{where}")
    return v


def _nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _passed(epoch: int, milestones: Sequence[int]) -> int:
    return sum(1 for m in milestones if epoch >= m)


@dataclass(frozen=True)
class KFACSchedule:
    """Base values and their epoch milestones."""

    damping: float | Callable[[int], float]
    factor_update_freq: int | Callable[[int], int]
    inv_update_freq: int | Callable[[int], int]
    damping_decay_epochs: Sequence[int] = field(default_factory=tuple)
    damping_decay_rate: float = 1.0
    update_freq_decay_epochs: Sequence[int] = field(default_factory=tuple)
    update_freq_decay_rate: float = 1.0

    def __post_init__(self) -> None:
        if not callable(self.damping) and not self.damping >= 0:
            raise ValueError(f"K-FAC damping must be >= 0, got {self.damping}")
        for key in ("factor_update_freq", "inv_update_freq"):
            v = getattr(self, key)
            if not callable(v) and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"K-FAC {key} must be a positive integer (steps), got {v!r}")
        if not self.damping_decay_rate > 0:
            raise ValueError(f"K-FAC damping_decay_rate must be > 0, got {self.damping_decay_rate}")
        if not self.update_freq_decay_rate > 0:
            raise ValueError(f"K-FAC update_freq_decay_rate must be > 0, got {self.update_freq_decay_rate}")
        for key in ("damping_decay_epochs", "update_freq_decay_epochs"):
            if any(int(e) < 0 for e in getattr(self, key)):
                raise ValueError(f"K-FAC {key} must hold epochs >= 0, got {list(getattr(self, key))}")

    def damping_at(self, epoch: int, step: int = 0) -> float:
        base = value_at("damping", self.damping, step, _nonneg, ">= 0")
        return base * self.damping_decay_rate ** _passed(epoch, self.damping_decay_epochs)

    def _freq(self, name: str, base: int | Callable[[int], int], epoch: int, step: int) -> int:
        value = value_at(name, base, step, _positive_int, "a positive integer (steps)")
        return max(1, int(round(value * self.update_freq_decay_rate ** _passed(epoch, self.update_freq_decay_epochs))))

    def factor_update_freq_at(self, epoch: int, step: int = 0) -> int:
        return self._freq("factor_update_freq", self.factor_update_freq, epoch, step)

    def inv_update_freq_at(self, epoch: int, step: int = 0) -> int:
        return self._freq("inv_update_freq", self.inv_update_freq, epoch, step)


def spread_phases(costs: Sequence[int], interval: int) -> list[int]:
    """The phase in ``[0, interval)`` of each of the work items of ``costs`` (``spread_decompositions``: item
    ``j`` is done at the steps ``s`` with ``s % interval == phases[j]``): longest first, each to the phase with the
    least cost so far (the lowest on ties), so every step of the interval carries about the same cost. A pure
    function of the costs and the interval: every rank, and a resumed run, computes the same phases."""
    phases = [0] * len(costs)
    load = [0] * max(1, interval)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):  # stable: ties keep the item order
        p = min(range(len(load)), key=load.__getitem__)
        phases[j] = p
        load[p] += costs[j]
    return phases


class SpreadDecompositions:
    """Which factors ``spread_decompositions`` decomposes at a step: the ``(layer index, factor name)`` pairs of
    the handlers whose phase (:func:`spread_phases` of the factors' decomposition costs, their forms'
    ``cost``) is the step's place in the interval. Kept for the interval they were made for."""

    def __init__(self) -> None:
        self._phases: tuple[int, dict[tuple[int, str], int]] | None = None

    def due(self, handlers: Sequence[Any], interval: int, step: int) -> set[tuple[int, str]]:
        if self._phases is None or self._phases[0] != interval:
            items = [(i, kind, form.cost) for i, h in enumerate(handlers) for kind, form in h.factor_forms().items()]
            phases = spread_phases([cost for _, _, cost in items], interval)
            self._phases = interval, {(i, kind): p for (i, kind, _), p in zip(items, phases)}
        return {item for item, p in self._phases[1].items() if p == step % interval}

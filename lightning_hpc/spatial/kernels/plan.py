"""What every tile kernel shares: the halo plan of a call from its per-dimension windows, the acceptance check
with a clear :class:`PartitionError`, and the normalisation of torch's int-or-tuple arguments.

A kernel describes its halo by ONE window function (per split dimension, an object with ``out_size(n)`` and
``needed(o0, o1, n)``, e.g. :class:`~lightning_hpc.spatial.layout.halo_exchange.Window1d`); :func:`halo_plan` turns the
windows into the exchange of section III-A, and :func:`check_partition` is the same test without a grid, for a
setup-time check or a planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.layout.halo_exchange import DimPlan, HaloPlan, PartitionError
from lightning_hpc.spatial.layout.tiling import SpatialGrid, parts_text

__all__ = [
    "dim_names", "ntuple", "halo_plan", "check_partition", "check_tile", "largest_split", "output_extents",
    "autocast_cast",
]

_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}


def dim_names(k: int) -> tuple[str, ...]:
    """Names of ``k`` split dimensions in messages: L; H, W; D, H, W."""
    return _NAMES.get(k, tuple(f"dim{e}" for e in range(k)))


def ntuple(value: Any, k: int, what: str) -> tuple[int, ...]:
    """An int-or-sequence argument of a torch op as ``k`` ints (as torch's ``_ntuple`` expands it)."""
    if isinstance(value, int):
        return (value,) * k
    out = tuple(int(v) for v in value)
    if len(out) == 1:
        return out * k
    if len(out) != k:
        raise ValueError(f"{what}={tuple(value)}: expected one int or {k} ints (one per spatial dimension)")
    return out


def _dim_plan(n: int, parts: int, window: Any, what: str) -> DimPlan:
    return DimPlan(n, window.out_size(n), parts, window, what=what)


def largest_split(n: int, parts: int, window: Any) -> int:
    """The largest number of blocks ``<= parts`` an extent ``n`` can be split into for ``window`` (every tile at
    least as thick as the halo its output needs)."""
    for q in range(parts, 1, -1):
        try:
            _dim_plan(n, q, window, "")
            return q
        except PartitionError:
            continue
    return 1


def check_partition(extents: Sequence[int], parts: Sequence[int], windows: Sequence[Any],
                    op: str = "") -> list[DimPlan]:
    """The plan of each split dimension; :class:`PartitionError` unless every tile of ``extents`` split ``parts``
    (blocked) can compute its output block from its own entries and its direct neighbours' (section III-A): the
    message names the dimension and the largest split of it that works."""
    if not len(extents) == len(parts) == len(windows):
        raise ValueError(f"{op}: {len(extents)} extents, {len(parts)} parts and {len(windows)} windows: one per split "
                         f"dimension")
    names = dim_names(len(extents))
    out = []
    for e, (n, p, win) in enumerate(zip(extents, parts, windows)):
        try:
            out.append(_dim_plan(n, p, win, names[e]))
        except PartitionError as err:
            best = largest_split(n, p, win)
            raise PartitionError(
                f"{op + ': ' if op else ''}input {parts_text(extents)} split {parts_text(parts)}: {err}; the largest "
                f"split of {names[e]} (split dimension {e}) that works is {best}"
            ) from None
    return out


_CACHE: dict[tuple, HaloPlan] = {}


def halo_plan(grid: SpatialGrid, extents: Sequence[int], windows: Sequence[Any], op: str = "",
              tile: torch.Tensor | None = None) -> HaloPlan:
    """The halo plan of this rank for an input whose split dimensions have global ``extents`` (a pure function of
    the grid position, extents and windows: cached).  ``tile``: this rank's tile, checked against the plan's
    block (:func:`check_tile`'s error when it is not)."""
    extents = tuple(int(n) for n in extents)
    windows = tuple(windows)
    key = (id(grid), grid.local_rank, extents, windows)
    plan = _CACHE.get(key)
    if plan is None or plan.grid is not grid:
        if tile is not None:
            check_tile(tile, grid, extents, op)
        plan = HaloPlan(grid, *check_partition(extents, grid.parts, windows, op))
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = plan
    k = plan.ndim
    if tile is not None and (tile.dim() < k + 1 or tuple(tile.shape[-k:]) != tuple(hi - lo for lo, hi in plan.own)):
        check_tile(tile, grid, extents, op)
    return plan


def output_extents(extents: Sequence[int], windows: Sequence[Any]) -> tuple[int, ...]:
    """Global output extents of the split dimensions."""
    return tuple(win.out_size(int(n)) for n, win in zip(extents, windows))


def check_tile(x: torch.Tensor, grid: SpatialGrid, extents: Sequence[int], op: str) -> None:
    """Raise unless ``x``'s split dimensions have this rank's block of ``extents`` (the layout every kernel
    assumes)."""
    k = grid.ndim
    if len(extents) != k or x.dim() < k + 1:
        raise ValueError(f"{op}: a tile with {k} split dimensions after batch/channel dimensions and {k} global "
                         f"extents expected, got shape {tuple(x.shape)} and extents {tuple(extents)}")
    for e, (n, p) in enumerate(zip(extents, grid.parts)):
        if n < p:
            raise PartitionError(f"{op}: {dim_names(k)[e]} extent {n} is smaller than the {p} parts it is split into; "
                                 f"the largest split that works is {n}")
    want = tuple(hi - lo for lo, hi in (block_bounds(n, p)[i] for n, p, i in zip(extents, grid.parts, grid.index)))
    if tuple(x.shape[-k:]) != want:
        raise PartitionError(f"{op}: local tile {tuple(x.shape[-k:])} is not block {grid.index} of an input "
                             f"{parts_text(extents)} split {parts_text(grid.parts)} (expected {want})")


def autocast_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as autocast casts an operand of a lower-precision op: floating tensors other than float64 to
    ``dtype``, the rest unchanged (``is_eligible`` in torch's autocast)."""
    if not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)

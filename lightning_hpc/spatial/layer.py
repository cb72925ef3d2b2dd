"""Shared machinery of the spatially partitioned layers: grid, global extents, layout checks, errors.

Every activation of a converted model is blocked over the spatial grid with the same rule as the input
(:func:`lightning_hpc.distributed.partition.block_bounds` over H and W).  A layer recovers the global extent of
its input from the local tile sizes (one tiny allreduce), checks the tile has the size the layout says, and
builds its halo plan, which is a pure function of the global extent and is cached.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.halo_exchange import DimPlan, HaloPlan, PartitionError
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialLayer", "SpatialContext", "largest_working_parts", "PartitionError"]


class SpatialContext:
    """Per-forward state of a converted model: the global extent of the model's input (one allreduce per
    forward, in a pre-hook on the model) and a call counter, so each layer can cache the global extent of its
    own input under ``(model input extent, call index)`` instead of allreducing it on every call.  The key is
    the same on every rank of the group, so all ranks hit or miss the cache together (no rank can skip a
    collective the others enter)."""

    def __init__(self, grid: SpatialGrid) -> None:
        self.grid = grid
        self.input_hw: tuple[int, ...] | None = None
        self.depth = 0
        self.calls = 0

    def pre_hook(self, module: torch.nn.Module, args: tuple) -> None:
        if self.depth == 0:
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), None)
            self.input_hw = None if x is None else self.grid.global_extent(x.shape[-2], x.shape[-1], device=x.device)
            self.calls = 0
        self.depth += 1

    def post_hook(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.input_hw = None

    def next_key(self) -> tuple[tuple[int, ...], int] | None:
        if self.input_hw is None:
            return None
        self.calls += 1
        return self.input_hw, self.calls


def _works(n: int, parts: int, window: Any) -> bool:
    try:
        DimPlan(n, window.out_size(n), parts, window)
        return True
    except PartitionError:
        return False


def largest_working_parts(h: int, w: int, windows: tuple[Any, Any], parts: tuple[int, ...]) -> tuple[int, int]:
    """Largest ``(ph', pw')`` with ``ph' <= ph`` and ``pw' <= pw`` this layer can be split into."""
    best = []
    for n, window, p in ((h, windows[0], parts[0]), (w, windows[1], parts[1])):
        q = p
        while q > 1 and not _works(n, q, window):
            q -= 1
        best.append(q)
    return best[0], best[1]


class SpatialLayer:
    """Mixin for layers that run on one tile of a blocked H x W partition."""

    grid: SpatialGrid
    spatial_name: str

    def _init_spatial(self, grid: SpatialGrid, name: str = "") -> None:
        self.grid = grid
        self.spatial_name = name or type(self).__name__
        self._plans: dict[tuple[int, int], HaloPlan] = {}
        self._extents: dict = {}
        self.spatial_context: SpatialContext | None = None
        self._known_extent: tuple[int, int] | None = None
        #: set by the strategy: inputs are SpatialTensors; a plain input is replicated (the serial layer runs)
        self.spatial_dispatch = False

    def _serial_input(self, x: torch.Tensor) -> bool:
        """Whether this call runs the serial layer: one tile per sample, or (under op dispatch) an input that is
        not split (e.g. a BatchNorm after a global pooling)."""
        return self.grid.size == 1 or (
            getattr(self, "spatial_dispatch", False) and getattr(self, "_known_extent", None) is None
        )

    def tile_call(self, x: torch.Tensor, extent: tuple[int, int]) -> torch.Tensor:
        """Run this layer on the plain tile ``x`` of an input whose global (H, W) is ``extent`` (no extent
        allreduce)."""
        # a plain attribute written straight into the instance: nn.Module.__setattr__ would first check whether it is
        # a parameter, buffer or submodule, twice per layer call
        self.__dict__["_known_extent"] = (int(extent[0]), int(extent[1]))
        try:
            return type(self).forward(self, x)  # type: ignore[attr-defined]  # the nn.Module's it is mixed into
        finally:
            self.__dict__["_known_extent"] = None

    def spatial_call(self, x: Any) -> torch.Tensor:
        """Forward of a :class:`~lightning_hpc.spatial.dispatch.SpatialTensor`: the tile kernel on its local tile,
        the output split the same way (or replicated, for a global pooling)."""
        from lightning_hpc.spatial.dispatch import SpatialDispatchError, SpatialTensor, _plain, state

        computed = [n for n in ("weight", "bias") if getattr(self, n, None) is not None and
                    self._parameters.get(n) is None]  # type: ignore[attr-defined]
        if x.dim() != 4 or x._sdims != (2, 3) or computed:
            # laid out otherwise (e.g. after x.transpose(2, 3)), or a weight computed from the parameters by a
            # forward pre-hook (the hook form of spectral_norm / weight_norm, whose source parameter is used on
            # replicated values, not on tiles): the serial layer's own forward, whose functional call the op
            # dispatch computes (tiled where it can, else gathered; a computed weight has its gradient summed over
            # the tiles there)
            return self.serial_forward(x)
        st = state()
        st.note_params(self._parameters.values())  # type: ignore[attr-defined]  # = parameters(recurse=False)
        h, w = x._gshape[2], x._gshape[3]
        st.depth += 1
        try:
            out = self.tile_call(_plain(x), (h, w))
        except PartitionError as e:
            raise SpatialDispatchError(f"spatial: {e}") from None
        except RuntimeError as e:  # e.g. a wrong channel count: name the layer
            if isinstance(e, SpatialDispatchError) or "spatial" in str(e)[:40]:
                raise
            raise SpatialDispatchError(f"spatial: {type(self).__name__} {self.describe()}: {e}") from e
        finally:
            st.depth -= 1
        if getattr(self, "replicated_output", False):
            return out
        wh, ww = self.windows(h, w)
        return SpatialTensor.wrap(out, x._grid, (x._gshape[0], out.shape[1], wh.out_size(h), ww.out_size(w)), (2, 3),
                                  fresh=out is not x)

    def serial_forward(self, x: Any) -> torch.Tensor:
        """The forward of the ``torch.nn`` layer this one replaced (its functional call is dispatched)."""
        for cls in type(self).__mro__:
            if cls.__module__.startswith("torch.nn.") and cls is not nn.Module and "forward" in vars(cls):
                return vars(cls)["forward"](self, x)  # type: ignore[no-any-return]
        return F.adaptive_avg_pool2d(x, 1)  # the global average pooling (heads.py), the one layer of its own

    def windows(self, h: int, w: int) -> tuple[Any, Any]:  # pragma: no cover - abstract
        """The per-dimension window (``out_size``, ``needed``) of this layer for an ``h x w`` input."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"layer '{self.spatial_name}' ({self.extra_repr() if hasattr(self, 'extra_repr') else ''})"

    def partition_error(self, h: int, w: int, reason: str) -> PartitionError:
        ph, pw = self.grid.parts
        wh, ww = largest_working_parts(h, w, self.windows(h, w), self.grid.parts)
        return PartitionError(
            f"{type(self).__name__} {self.describe()} with input {h}x{w} cannot be split {ph}x{pw} (spatial_parts): "
            f"{reason}. The largest partition that works for this layer is {wh}x{ww}; use smaller spatial_parts "
            f"or a larger input"
        )

    def global_input_extent(self, x: torch.Tensor) -> tuple[int, int]:
        known = getattr(self, "_known_extent", None)
        if known is not None:
            h, w = known
            (h0, h1), (w0, w1) = self._tile_bounds_checked(h, w)
            if (h1 - h0, w1 - w0) != tuple(x.shape[-2:]):
                raise PartitionError(
                    f"{type(self).__name__} {self.describe()}: local tile {tuple(x.shape[-2:])} does not match the "
                    f"blocked layout of a {h}x{w} input over {self.grid.parts} (expected {(h1 - h0, w1 - w0)})"
                )
            return h, w
        ctx = getattr(self, "spatial_context", None)
        key = ctx.next_key() if ctx is not None else None
        cached = self._extents.get(key) if key is not None else None
        if cached is not None and cached[1] == tuple(x.shape[-2:]):
            return cached[0]
        h, w = self.grid.global_extent(x.shape[-2], x.shape[-1], device=x.device)
        if key is not None:
            if len(self._extents) > 64:
                self._extents.clear()
            self._extents[key] = ((h, w), tuple(x.shape[-2:]))
        (h0, h1), (w0, w1) = self._tile_bounds_checked(h, w)
        if (h1 - h0, w1 - w0) != tuple(x.shape[-2:]):
            raise PartitionError(
                f"{type(self).__name__} {self.describe()}: local tile {tuple(x.shape[-2:])} does not match the blocked "
                f"layout of a {h}x{w} input over {self.grid.parts} (expected {(h1 - h0, w1 - w0)}); tiles must follow "
                f"lightning_hpc.distributed.partition.block_bounds over H then W"
            )
        return h, w

    def _tile_bounds_checked(self, h: int, w: int):
        ph, pw = self.grid.parts
        if h < ph or w < pw:
            raise self.partition_error(h, w, "the input has fewer rows/columns than parts")
        i, j = self.grid.index
        return block_bounds(h, ph)[i], block_bounds(w, pw)[j]

    def halo_plan(self, h: int, w: int) -> HaloPlan:
        key = (h, w)
        plan = self._plans.get(key)
        if plan is None:
            wh, ww = self.windows(h, w)
            try:
                rows = DimPlan(h, wh.out_size(h), self.grid.parts[0], wh, what="H")
                cols = DimPlan(w, ww.out_size(w), self.grid.parts[1], ww, what="W")
            except PartitionError as e:
                raise self.partition_error(h, w, str(e)) from None
            plan = HaloPlan(self.grid, rows, cols)
            if len(self._plans) > 32:
                self._plans.clear()
            self._plans[key] = plan
        return plan

"""The split activation: :class:`SpatialTensor` holds one tile of an activation blocked over the spatial grid:
grid axis ``k`` splits tensor dimension ``sdims[k]`` (:func:`lightning_hpc.distributed.partition.block_bounds`
over each), like DTensor's ``Shard(sdims[k])`` placement on mesh dimension ``k``, and reports the *global* shape
(see the package docstring).  Its ``__torch_function__`` is :func:`registry._torch_function`, which the registry
installs when it is imported (the package's ``__init__`` imports it before any split tensor exists).

Also the functions that make, cut and gather split tensors (:func:`split_tensor`, :func:`gather_tensor`,
:func:`local_tile`) and wrap a handler's local result with its global layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_hpc.spatial.dispatch.autograd import _Gather
from lightning_hpc.spatial.dispatch.calls import _flat
from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import Trace as _Trace


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A plain alias of ``t`` made by an operator a tracer records (see
    :class:`~lightning_hpc.spatial.layout.tracing.Trace`)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.ops.aten.alias.default(t)  # type: ignore[no-any-return]


def _plain(t: torch.Tensor) -> torch.Tensor:
    if _Trace.active:
        return _alias(t)
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class SpatialTensor(torch.Tensor):
    """One tile of an activation split over ``grid``: its dimension ``sdims[k]`` blocked over grid axis ``k`` (see
    the package docstring of :mod:`lightning_hpc.spatial.dispatch`)."""

    _grid: SpatialGrid
    _gshape: tuple[int, ...]
    _sdims: tuple[int, ...]

    @staticmethod
    def wrap(local: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], sdims: Sequence[int], *,
             fresh: bool = False) -> SpatialTensor:
        """``fresh``: ``local`` is a new result nobody else holds; it becomes the SpatialTensor itself (no alias
        view, so a later in-place op on it is not an in-place op on a view, which autograd would answer with a
        whole-tensor copy in backward)."""
        # the number of dimensions from the global shape (the tile has as many): asking the tensor, once it is a
        # SpatialTensor, would be a dispatched call
        if type(gshape) is not tuple or type(sdims) is not tuple or (sdims and min(sdims) < 0):
            gshape = tuple(map(int, gshape))
            sdims = tuple(d % len(gshape) for d in sdims)
        t: SpatialTensor
        if fresh and type(local) is torch.Tensor:
            local.__class__ = SpatialTensor
            t = local  # type: ignore[assignment]  # its class was just set (typing.cast costs a call per op)
        elif _Trace.active:
            t = _alias(local)  # type: ignore[assignment]
            t.__class__ = SpatialTensor
        else:
            with torch._C.DisableTorchFunctionSubclass():
                t = local.as_subclass(SpatialTensor)  # type: ignore[assignment]
        t._grid, t._gshape, t._sdims = grid, gshape, sdims
        return t

    def dim(self) -> int:  # type: ignore[override]
        """The number of dimensions (global and tile alike), answered without the op dispatch: the tiled handlers
        ask it of every split operand, several times per op."""
        gshape = self.__dict__.get("_gshape")
        if gshape is None:  # made by torch itself without a layout (never by the dispatch)
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.dim(self)
        return len(gshape)

    def local(self) -> torch.Tensor:
        """This rank's tile as a plain tensor (same autograd graph)."""
        return _plain(self)

    def full(self) -> torch.Tensor:
        """The whole activation on every rank (one all-gather; differentiable)."""
        if _Trace.active:  # an operator a graph holds, with the same adjoint (graph_ops)
            return torch.ops.lightning_hpc.gather_whole(_plain(self), key_of(self._grid), list(self._gshape),
                                                         list(self._sdims))
        return _Gather.apply(_plain(self), self._grid, self._gshape, self._sdims)

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The dimensions actually divided among ranks (a dimension with one part is whole on every rank)."""
        return tuple(d for d, p in zip(self._sdims, self._grid.parts) if p > 1)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return (f"SpatialTensor(global shape {tuple(self._gshape)}, split dims {self._sdims} over "
                f"{self._grid.parts}, tile={_plain(self)!r})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # replaced by registry._torch_function when the registry is imported: the handler modules (and the
        # registry) import this module, so it cannot import them
        raise RuntimeError("the spatial op registry is not installed: import lightning_hpc.spatial.dispatch")


def split_tensor(tile: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int],
                 sdims: Sequence[int] | None = None) -> SpatialTensor:
    """Wrap this rank's tile (already cut) of a tensor of global shape ``gshape``; ``sdims``: the dimensions split
    over the grid's axes (default: the last ``grid.ndim``)."""
    return SpatialTensor.wrap(tile, grid, gshape, tuple(range(-grid.ndim, 0)) if sdims is None else sdims)


def gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered) for a split one, else ``t``."""
    return t.full() if isinstance(t, SpatialTensor) else t


#: set on the plain tiles :func:`local_tile` returns: a torchmetrics object fed one counts it as a tile (summed over
#: all ranks), not as a replicated value (:mod:`lightning_hpc.spatial.lightning.metrics`)
TILE_MARK = "_lightning_hpc_spatial_tile"


def local_tile(t: torch.Tensor) -> torch.Tensor:
    """This rank's tile as a plain tensor for a split one, else ``t``: for statistics whose per-rank counts are
    summed over all ranks anyway (confusion counts of segmentation metrics), so nothing is gathered.  The tile is
    marked (:data:`TILE_MARK`) so a metric fed it sums it over the tiles."""
    if not isinstance(t, SpatialTensor):
        return t
    out = t.local()
    setattr(out, TILE_MARK, True)
    return out


def _spatials(args, kwargs) -> list[SpatialTensor]:
    return [t for t in _flat(args, kwargs) if isinstance(t, SpatialTensor)]


def _layout(t: SpatialTensor):
    return (t._grid, t._gshape, t._sdims)


def _fresh(local: torch.Tensor, grid: SpatialGrid, gshape: tuple[int, ...], sdims: tuple[int, ...]) -> SpatialTensor:
    """``SpatialTensor.wrap(local, grid, gshape, sdims, fresh=True)`` for a layout already in its normal form (a
    tuple global shape, the split dimensions of a split tensor): the handlers' per-op wrap, without the checks."""
    if type(local) is torch.Tensor:
        local.__class__ = SpatialTensor
        local._grid, local._gshape, local._sdims = grid, gshape, sdims  # type: ignore[attr-defined]
        return local  # type: ignore[return-value]  # its class was just set
    return SpatialTensor.wrap(local, grid, gshape, sdims, fresh=True)


def _wrap_like(local: torch.Tensor, ref: SpatialTensor, gshape=None, sdims=None) -> SpatialTensor:
    if gshape is None and sdims is None:  # ``ref``'s own layout
        return _fresh(local, ref._grid, ref._gshape, ref._sdims)
    return SpatialTensor.wrap(local, ref._grid, ref._gshape if gshape is None else gshape,
                              ref._sdims if sdims is None else sdims, fresh=True)


def _wrap_reduced(out: torch.Tensor, x: SpatialTensor, dims: Sequence[int], keepdim: bool) -> SpatialTensor:
    """``out``, the tile of ``x`` reduced over some of its unsplit dimensions ``dims``, with its global layout."""
    g = [1 if d in dims else n for d, n in enumerate(x._gshape) if keepdim or d not in dims]
    return _wrap_like(out, x, g, x._sdims if keepdim else dims_without(x._sdims, dims))


def dims_without(sdims: Sequence[int], removed: Sequence[int]) -> tuple[int, ...]:
    """``sdims`` once the dimensions ``removed`` (none of them split) are dropped from the tensor."""
    return tuple(s - sum(1 for d in removed if d < s) for s in sdims)


def dims_with(sdims: Sequence[int], inserted: int) -> tuple[int, ...]:
    """``sdims`` once a dimension is inserted at position ``inserted``."""
    return tuple(s + (inserted <= s) for s in sdims)


def _nbytes(t: torch.Tensor, shape) -> int:
    return int(math.prod(shape)) * t.element_size()


def _channels_first(x, ndim: int | None = None) -> bool:
    """``x`` is ``N x C x spatial...`` split along its spatial dimensions in order (as a sample's input is), with
    ``ndim`` spatial dimensions when given: the layout the tiled kernels take."""
    if not isinstance(x, SpatialTensor):
        return False
    k = x._grid.ndim
    return (ndim is None or ndim == k) and x.dim() == 2 + k and x._sdims == tuple(range(2, 2 + k))


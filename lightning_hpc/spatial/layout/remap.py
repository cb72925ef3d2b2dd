"""Exact re-indexing of a split activation along one split dimension: ``out[o] = x[src(o)]`` with ``src`` any
map from global output to global input indices (or to nothing: a zero), both blocked over the same grid line.

This covers the ops whose output rows are input rows moved, repeated or mirrored rather than combined:

* ``F.pad`` with ``mode`` ``"reflect"`` / ``"replicate"`` / ``"circular"`` (``nn.Conv2d(padding_mode=...)``
  pads this way before a convolution with padding 0): output row ``o`` of a dimension padded ``(lo, hi)`` is
  input row ``m(o - lo)`` with ``m`` the mirror (``-i``, ``2(n-1)-i``), the clamp to ``[0, n)`` or the wrap
  ``i mod n``.  Interior rows and the seams come from the tile itself and its neighbours; the mirrored rows at
  an image border come from the first/last tiles (their own rows for reflect and replicate, the opposite end of
  the grid line for circular), whatever the tile sizes;
* ``F.pixel_shuffle`` / ``F.pixel_unshuffle``: local on each tile, with a re-blocking between the scaled tile
  bounds ``r * block_bounds(n)`` and the blocked layout ``block_bounds(r * n)`` of the other extent (the rows
  that cross a boundary, at most a few per tile, move to the neighbour);
* constant ``F.pad`` (``nn.ZeroPad2d``, ``nn.ConstantPad2d``), negative padding (a crop) included, and slicing
  ``x[..., a:b:s, c:d:t]`` (a U-Net's centre crop, a strided subsample): output row ``o`` is input row
  ``o - lo`` (or ``a + s * o``) or, for a padded row, the constant (:func:`constant_pad_source`, ``fill``).  The
  leading rows go to the first tiles and the trailing ones to the last, and the output is re-blocked over its own
  extent, so rows a crop removes or a pad adds shift the tile boundaries and the few rows that cross one move to
  the neighbour (a crop wider than a tile empties that tile's share: its rows come from the next tiles).

Every rank of the grid line knows the whole map, so each pair of tiles exchanges exactly the rows one needs of
the other (one message each way, none when nothing is needed); ops of several split dimensions apply the map
of each in turn to the result (corners included).  Backward is the adjoint: each output row's gradient goes back
to the row it came from and is added there (a mirrored or replicated row collects several).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.p2p import exchange
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import Trace, refuse_trace

__all__ = ["RemapPlan", "remap", "pad_source", "constant_pad_source", "PAD_MODES"]

Range = tuple[int, int]
PAD_MODES = ("reflect", "replicate", "circular")


def pad_source(n: int, lo: int, hi: int, mode: str) -> list[int] | None:
    """Global input index of every output index of one dimension of extent ``n`` padded ``(lo, hi)`` with
    ``mode`` (as ``F.pad`` computes it), or ``None`` for a padding ``F.pad`` refuses (so the serial op's error
    is what the caller sees)."""
    if min(lo, hi) < 0 or (mode == "reflect" and max(lo, hi) >= n) or (mode == "circular" and max(lo, hi) > n):
        return None
    out = []
    for o in range(n + lo + hi):
        i = o - lo
        if mode == "reflect":
            i = -i if i < 0 else (2 * (n - 1) - i if i >= n else i)
        elif mode == "replicate":
            i = min(max(i, 0), n - 1)
        else:
            i %= n
        out.append(i)
    return out


def constant_pad_source(n: int, lo: int, hi: int) -> list[int]:
    """Global input index of every output index of one dimension of extent ``n`` padded ``(lo, hi)`` with a
    constant (``-1``: the constant); a negative ``lo`` / ``hi`` crops as ``F.pad`` does."""
    return [i if 0 <= i < n else -1 for i in (o - lo for o in range(max(n + lo + hi, 0)))]


def _owner(bounds: Sequence[Range], i: int) -> int:
    for q, (a, b) in enumerate(bounds):
        if a <= i < b:
            return q
    raise ValueError(f"index {i} is outside the tiles {list(bounds)}")


@dataclass(frozen=True)
class RemapPlan:
    """This rank's part of one remap along grid axis ``axis`` (the index of the split dimension in the grid).

    ``recvs``: per peer position ``q`` along the axis, the local output positions it fills and the local input
    indices of ``q`` it reads (``q`` equal to this rank's position: the rows copied locally); ``sends``: per peer,
    the local input indices it needs from this tile, in the order of its output positions."""

    axis: int
    n_out_local: int
    pos: int
    recvs: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    sends: tuple[tuple[int, tuple[int, ...]], ...]
    #: the index tensors, made once per (index list, device): made from host lists on every call, each would be an
    #: upload per call (on a GPU, a wait for the queue)
    _indices: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def index(self, idx: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``idx`` (one of this plan's own index tuples, which live as long as the plan: keyed by identity) as an
        index tensor on ``device``."""
        key = (id(idx), device)
        out = self._indices.get(key)
        if out is None:
            out = self._indices[key] = torch.tensor(idx, dtype=torch.long, device=device)
        return out

    @classmethod
    def build(cls, grid: SpatialGrid, axis: int, in_bounds: Sequence[Range], out_bounds: Sequence[Range],
              src: Sequence[int]) -> RemapPlan:
        """``in_bounds`` / ``out_bounds``: the global ranges the tiles along the axis hold before and after;
        ``src[o]``: the global input index of global output ``o`` (``-1``: zero)."""
        me = grid.index[axis]
        recvs: dict[int, tuple[list[int], list[int]]] = {}
        o0, o1 = out_bounds[me]
        for o in range(o0, o1):
            if src[o] >= 0:
                q = _owner(in_bounds, src[o])
                pos, idx = recvs.setdefault(q, ([], []))
                pos.append(o - o0)
                idx.append(src[o] - in_bounds[q][0])
        sends = []
        a, b = in_bounds[me]
        for q, (p0, p1) in enumerate(out_bounds):
            if q != me:
                idx = [src[o] - a for o in range(p0, p1) if a <= src[o] < b]
                if idx:
                    sends.append((q, tuple(idx)))
        recv = tuple((q, tuple(p), tuple(i)) for q, (p, i) in sorted(recvs.items()))
        return cls(axis, o1 - o0, me, recv, tuple(sends))


def _peer(grid: SpatialGrid, axis: int, q: int) -> int:
    """The rank whose tile is at position ``q`` along ``axis`` on this rank's grid line."""
    index = list(grid.index)
    index[axis] = q
    return grid.global_rank(*index)


def _exchange(grid: SpatialGrid, plan: RemapPlan, tag: int, outgoing: dict[int, torch.Tensor],
              incoming: dict[int, torch.Tensor]) -> None:
    """Post the receives into ``incoming`` and the sends of ``outgoing`` (peer position -> tensor) and wait."""
    recvs = [(buf, _peer(grid, plan.axis, q), tag) for q, buf in incoming.items()]
    sends = [(buf, _peer(grid, plan.axis, q), tag) for q, buf in outgoing.items()]
    for w in exchange(sends, recvs, grid.group):  # one batch: NCCL-safe (see distributed/p2p.py)
        w.wait()


def remap_forward(x: torch.Tensor, grid: SpatialGrid, plan: RemapPlan, dim: int, fill: float,
                  tag: int) -> torch.Tensor:
    """``out[o] = x[src(o)]`` along ``dim`` on this rank's tile (the messages tagged ``tag``)."""
    shape = list(x.shape)
    shape[dim] = plan.n_out_local
    out = x.new_full(shape, fill) if fill else x.new_zeros(shape)
    incoming = {}
    for q, pos, _ in plan.recvs:
        if q != plan.pos:
            shape[dim] = len(pos)
            incoming[q] = x.new_empty(shape)
    outgoing = {q: x.index_select(dim, plan.index(idx, x.device)).contiguous() for q, idx in plan.sends}
    _exchange(grid, plan, tag, outgoing, incoming)
    for q, pos, idx in plan.recvs:
        rows = incoming[q] if q != plan.pos else x.index_select(dim, plan.index(idx, x.device))
        out.index_copy_(dim, plan.index(pos, x.device), rows)
    return out


def remap_backward(g: torch.Tensor, shape: Sequence[int], grid: SpatialGrid, plan: RemapPlan, dim: int,
                   tag: int) -> torch.Tensor:
    """The adjoint of :func:`remap_forward`: each output row's gradient sent back to its source row and added
    there (the tile's gradient, of ``shape``)."""
    grad = g.new_zeros(shape)
    outgoing = {q: g.index_select(dim, plan.index(pos, g.device)).contiguous()
                for q, pos, _ in plan.recvs if q != plan.pos}
    buf_shape = list(shape)
    incoming = {}
    for q, idx in plan.sends:
        buf_shape[dim] = len(idx)
        incoming[q] = g.new_empty(buf_shape)
    _exchange(grid, plan, tag, outgoing, incoming)
    for q, pos, idx in plan.recvs:
        if q == plan.pos:
            grad.index_add_(dim, plan.index(idx, g.device), g.index_select(dim, plan.index(pos, g.device)))
    for q, idx in plan.sends:
        grad.index_add_(dim, plan.index(idx, g.device), incoming[q])
    return grad


class _Remap(torch.autograd.Function):
    """``out[o] = x[src(o)]`` along ``dim`` (see :class:`RemapPlan`); backward sends each output row's gradient
    back to its source row and adds it there."""

    @staticmethod
    def forward(ctx, x, grid: SpatialGrid, plan: RemapPlan, dim: int, fill: float):  # type: ignore[override]
        refuse_trace("a remap in its eager form")
        tag = grid.next_tag()
        ctx.args, ctx.shape = (grid, plan, dim, tag), x.shape
        return remap_forward(x, grid, plan, dim, fill, tag)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, plan, dim, tag = ctx.args
        return remap_backward(g, ctx.shape, grid, plan, dim, tag + 1), None, None, None, None


_PLANS: dict[tuple, RemapPlan] = {}


def remap(x: torch.Tensor, grid: SpatialGrid, axis: int, dim: int, in_bounds: Sequence[Range],
          out_bounds: Sequence[Range], src: Sequence[int], fill: float = 0.0) -> torch.Tensor:
    """This rank's output tile of ``out[o] = x[src[o]]`` along tensor dimension ``dim`` (split over grid axis
    ``axis``), ``x`` the plain local tile (see :class:`RemapPlan` for the arguments; ``fill``: the value of the
    outputs with ``src[o] = -1``).  Must be called by every rank of the group (the plans agree, so every message
    has its partner)."""
    key = (id(grid), grid.index, axis, tuple(in_bounds), tuple(out_bounds), tuple(src))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        plan = _PLANS[key] = RemapPlan.build(grid, axis, in_bounds, out_bounds, src)
    # decided from the global map, the same on every rank: each remap takes one message tag on all of them
    if tuple(in_bounds) == tuple(out_bounds) and all(s == o for o, s in enumerate(src)):
        return x
    if Trace.active:  # an operator a graph holds, with its adjoint (graph_ops)
        return torch.ops.lightning_hpc.remap_rows(  # type: ignore[no-any-return]
            x, key_of(grid), key_of(plan), dim % x.dim(), float(fill))
    return _Remap.apply(x, grid, plan, dim % x.dim(), fill)


def blocked(n: int, parts: int, scale: int = 1) -> list[Range]:
    """``block_bounds(n, parts)`` scaled by ``scale`` (the bounds of a tile's rows after an op that makes ``scale``
    rows of each input row)."""
    return [(a * scale, b * scale) for a, b in block_bounds(n, parts)]

"""The split step's communication as custom operators (``torch.library.custom_op``) that a compiler keeps in its
graph: the halo exchange (Dryden et al., section III-A) and the two sums over the spatial group (section III-B).

A traced split step (:mod:`lightning_hpc.spatial.compile`) is a graph of plain tile ops and these
operators.  Each carries its own adjoint (``register_autograd``), so the compiler derives the backward graph:

* ``halo_box``: the tile extended by the blocks of the neighbours' tiles its windows read.  Its adjoint sends
  each received block's gradient back to its owner and adds what the neighbours send into the tile's edge
  entries: the same messages as :class:`~lightning_hpc.spatial.layout.halo_exchange.HaloExchange` in eager mode.
  The box is one output every layer reads, so the adjoint runs on every rank that exchanged (an operator whose
  outputs were only the received blocks would have no output on a rank that only sends, and its backward would
  never run there, leaving its neighbour waiting).
* ``remap_rows``: rows moved between tiles (pixel shuffle, strided slices, crops that re-block); adjoint:
  each output row's gradient sent back to its source row.
* ``sum_partial``: the sum over the group of per-tile parts of a value every tile then uses (batch and row
  statistics); adjoint: the same sum of the per-tile partial gradients.
* ``sum_replicated``: the sum over the group of a value every rank then uses identically (losses, global
  pooling feeding a replicated head); adjoint: the identity (each rank holds the whole gradient already).
* ``complete_gradient``: the identity on a replicated tensor that meets tiles; adjoint: the sum over the group.
* ``gather_whole``: the whole activation on every rank from the tiles (an op with no tiled form, computed on the
  whole tensor); adjoint: this tile's part of the (complete) gradient.
* ``tile_of``: this tile of a replicated whole tensor (such an op's result split again, a replicated operand cut
  to the tiles); adjoint: the tile's gradient placed in zeros and summed over the group (``tile_of_adjoint``).

An adjoint is operators over the forward's arguments only, resolved when it runs: the backward graph derived from
it is cached under the forward graph's key (inductor's and AOTAutograd's caches), which every rank of a group
shares when their forward graphs are alike, and other processes share too; an index or a key worked out while the
backward is traced would be one rank's or one process's for all.

Plans and process groups are objects; an operator's arguments are tensors and numbers, so each object is
referred to by a key (:mod:`~lightning_hpc.spatial.layout.op_keys`).  The kernels call the operators by name
(``torch.ops.lightning_hpc.*``), so this module depends on them and not the reverse; it is imported by
:mod:`lightning_hpc.spatial.compile`, which is what traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc.distributed.p2p import exchange
from lightning_hpc.spatial.kernels.convolution import _box_ranges, _own_part, _rel, extended_box
from lightning_hpc.spatial.layout.halo_exchange import BACKWARD_TAG_OFFSET, Halo, HaloExchange, HaloPlan
from lightning_hpc.spatial.layout.op_keys import lookup
from lightning_hpc.spatial.layout.remap import remap_backward, remap_forward
from lightning_hpc.spatial.layout.whole import gather_tiles, tile_adjoint, tile_index

__all__: list[str] = []  # the operators are used by name: torch.ops.lightning_hpc.*


# -- halo exchange -------------------------------------------------------------------------------------------------
def _block_shape(x_shape: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    lead = list(x_shape[: len(x_shape) - len(ranges)])
    return lead + [hi - lo for lo, hi in ranges]


def _exchange_back(plan: HaloPlan, sends: list[tuple[torch.Tensor, int, int]],
                   recvs: list[tuple[torch.Tensor, int, int]]) -> None:
    """The adjoint's messages: the received blocks' gradients back to their owners.  Tags: fresh per exchange on
    every rank alike (every rank runs the same operators in the same order)."""
    tag = plan.grid.next_tag() + BACKWARD_TAG_OFFSET
    for w in exchange([(b, p, tag + d) for b, p, d in sends], [(b, p, tag + d) for b, p, d in recvs],
                      plan.grid.group):
        w.wait()


@torch.library.custom_op("lightning_hpc::halo_box", mutates_args=())
def _halo_box(x: torch.Tensor, plan_key: int, native: list[int], pad_value: float) -> torch.Tensor:
    plan: HaloPlan = lookup(plan_key)
    exchange = HaloExchange(plan)  # the eager exchange's messages; its backward half is the adjoint operator
    exchange.post_forward(x)
    blocks = exchange.finish_forward()
    if any(native):  # the convolution's box: the border it pads itself left out
        return extended_box(x, blocks, plan, native=native)
    box = Halo(x, blocks, plan).box(*(b for r in plan.need for b in r), pad_value=pad_value)
    # an operator's output may not alias its input (a box that is the tile itself, or a slice of it)
    return box.clone() if box.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else box.contiguous()


@_halo_box.register_fake
def _(x: torch.Tensor, plan_key: int, native: list[int], pad_value: float) -> torch.Tensor:
    return x.new_empty(_block_shape(x.shape, _box_ranges(lookup(plan_key), native)))


@torch.library.custom_op("lightning_hpc::halo_box_adjoint", mutates_args=())
def _halo_box_adjoint(grad_box: torch.Tensor, like: torch.Tensor, plan_key: int, native: list[int]) -> torch.Tensor:
    plan: HaloPlan = lookup(plan_key)
    box = _box_ranges(plan, native)
    sends = [(grad_box[_rel(r, box)].contiguous(), peer, d) for peer, d, *r in plan.recvs]
    recvs = [(like.new_empty(_block_shape(like.shape, r)), peer, d) for peer, d, *r in plan.sends]
    _exchange_back(plan, sends, recvs)
    out = torch.zeros_like(like)
    part = _own_part(plan, box)
    if all(hi > lo for lo, hi in part):  # the tile's entries the box holds (a strided window may skip its last)
        out[plan.local(part)] = grad_box[_rel(part, box)]
    for (_, _, *r), (buf, _, _) in zip(plan.sends, recvs):
        out[plan.local(r)] += buf
    return out


@_halo_box_adjoint.register_fake
def _(grad_box: torch.Tensor, like: torch.Tensor, plan_key: int, native: list[int]) -> torch.Tensor:
    return torch.empty_like(like)


def _halo_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, plan_key, native, _ = inputs
    ctx.plan_key, ctx.native = plan_key, native
    ctx.save_for_backward(x)  # only for its shape, dtype and device (the adjoint's tile gradient)


def _halo_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    (x,) = ctx.saved_tensors
    return torch.ops.lightning_hpc.halo_box_adjoint(grad, x, ctx.plan_key, ctx.native), None, None, None


_halo_box.register_autograd(_halo_backward, setup_context=_halo_setup)


# -- rows moved between tiles -----------------------------------------------------------------------------------
@torch.library.custom_op("lightning_hpc::remap_rows", mutates_args=())
def _remap_rows(x: torch.Tensor, grid_key: int, plan_key: int, dim: int, fill: float) -> torch.Tensor:
    grid = lookup(grid_key)
    return remap_forward(x, grid, lookup(plan_key), dim, fill, grid.next_tag())


@_remap_rows.register_fake
def _(x: torch.Tensor, grid_key: int, plan_key: int, dim: int, fill: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = lookup(plan_key).n_out_local
    return x.new_empty(shape)


@torch.library.custom_op("lightning_hpc::remap_rows_adjoint", mutates_args=())
def _remap_rows_adjoint(g: torch.Tensor, like: torch.Tensor, grid_key: int, plan_key: int,
                        dim: int) -> torch.Tensor:
    grid = lookup(grid_key)
    return remap_backward(g, like.shape, grid, lookup(plan_key), dim, grid.next_tag())


@_remap_rows_adjoint.register_fake
def _(g: torch.Tensor, like: torch.Tensor, grid_key: int, plan_key: int, dim: int) -> torch.Tensor:
    return torch.empty_like(like)


def _remap_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, ctx.grid_key, ctx.plan_key, ctx.dim, _ = inputs
    ctx.save_for_backward(x)  # for its shape, dtype and device


def _remap_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    (x,) = ctx.saved_tensors
    return torch.ops.lightning_hpc.remap_rows_adjoint(g, x, ctx.grid_key, ctx.plan_key, ctx.dim), None, None, None, None


_remap_rows.register_autograd(_remap_backward, setup_context=_remap_setup)


# -- sums over the group -----------------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group_key: int) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, group=lookup(group_key))
    return y


@torch.library.custom_op("lightning_hpc::sum_partial", mutates_args=())
def _sum_partial(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return _all_reduce(x, group_key)


@torch.library.custom_op("lightning_hpc::sum_replicated", mutates_args=())
def _sum_replicated(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return _all_reduce(x, group_key)


@torch.library.custom_op("lightning_hpc::complete_gradient", mutates_args=())
def _complete_gradient(x: torch.Tensor, group_key: int) -> torch.Tensor:
    return x.clone()


for _op in (_sum_partial, _sum_replicated, _complete_gradient):
    _op.register_fake(lambda x, group_key: torch.empty_like(x))


def _group_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group_key = inputs[1]


def _sum_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.lightning_hpc.sum_partial(grad, ctx.group_key), None


def _identity_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_sum_partial.register_autograd(_sum_backward, setup_context=_group_setup)
_sum_replicated.register_autograd(_identity_backward, setup_context=_group_setup)
_complete_gradient.register_autograd(_sum_backward, setup_context=_group_setup)


# -- a whole tensor and its tiles ----------------------------------------------------------------------------------
@torch.library.custom_op("lightning_hpc::gather_whole", mutates_args=())
def _gather_whole(local: torch.Tensor, grid_key: int, gshape: list[int], sdims: list[int]) -> torch.Tensor:
    return gather_tiles(local, lookup(grid_key), gshape, sdims).contiguous()


@_gather_whole.register_fake
def _(local: torch.Tensor, grid_key: int, gshape: list[int], sdims: list[int]) -> torch.Tensor:
    return local.new_empty(gshape)


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, ctx.grid_key, ctx.gshape, ctx.sdims = inputs


def _gather_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    # this tile's part through the operator, not an index worked out here (see the module docstring)
    return torch.ops.lightning_hpc.tile_of(g, ctx.grid_key, ctx.sdims), None, None, None


_gather_whole.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("lightning_hpc::tile_of", mutates_args=())
def _tile_of(x: torch.Tensor, grid_key: int, sdims: list[int]) -> torch.Tensor:
    return x[tile_index(x.shape, sdims, lookup(grid_key))].clone(memory_format=torch.contiguous_format)


@_tile_of.register_fake
def _(x: torch.Tensor, grid_key: int, sdims: list[int]) -> torch.Tensor:
    index = tile_index(x.shape, sdims, lookup(grid_key))
    return x.new_empty([len(range(*s.indices(n))) for s, n in zip(index, x.shape)])


def _tile_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, ctx.grid_key, ctx.sdims = inputs
    ctx.shape = tuple(x.shape)


def _tile_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    return torch.ops.lightning_hpc.tile_of_adjoint(g, ctx.grid_key, list(ctx.shape), ctx.sdims), None, None


@torch.library.custom_op("lightning_hpc::tile_of_adjoint", mutates_args=())
def _tile_of_adjoint(g: torch.Tensor, grid_key: int, shape: list[int], sdims: list[int]) -> torch.Tensor:
    return tile_adjoint(g, lookup(grid_key), shape, sdims)


@_tile_of_adjoint.register_fake
def _(g: torch.Tensor, grid_key: int, shape: list[int], sdims: list[int]) -> torch.Tensor:
    return g.new_empty(shape)


_tile_of.register_autograd(_tile_backward, setup_context=_tile_setup)

"""Halo exchange over a blocked partition of 1, 2 or 3 spatial dimensions (Dryden et al., section III-A;
overlap per section IV-A).

A layer whose output tile needs input entries held by neighbouring tiles (convolution, pooling, interpolation)
describes, per split dimension, which global input range an output range needs (:class:`Window1d` for sliding
windows).  :class:`DimPlan` turns that into, for every tile, the entries it owns, the entries its output needs
and therefore exactly which it must receive from / send to each neighbour along that dimension: nothing at all
for 1x1 stride-1 kernels, ``O = floor(K/2) * dilation`` for "same" convolutions, and the asymmetric ranges
strided kernels need when output tiles are re-blocked.  :class:`HaloPlan` combines one :class:`DimPlan` per
split dimension: a message goes to every neighbour in ``{-1, 0, 1}^k`` (in 3-D the 6 faces, 12 edges and 8
corners), each block straight to the tile that needs it, so every dimension is exchanged in one round and can
be overlapped with the interior computation.  There is no periodic wrap: the sample's border is padding.

Autograd: the exchange is split into :class:`_HaloStart` (identity; forward posts the sends/receives) and
:class:`_HaloFinish` (forward waits and hands out the received blocks).  Backward runs in the reverse order:
``_HaloFinish.backward`` posts the halo gradients back to their owners; ``_HaloStart.backward`` runs once every
other use of the tile has produced its gradient (the interior computation's backward in between overlaps the
exchange) and adds the received halo gradients into the tile.  This is the adjoint of the forward exchange
(tested with a dot-product test).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.p2p import exchange
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.layout.tracing import Trace, refuse_trace

__all__ = [
    "Window1d",
    "PartitionError",
    "DimPlan",
    "HaloPlan",
    "HaloExchange",
    "Halo",
    "halo_exchange",
    "trailing",
    "direction_id",
    "direction_delta",
    "BACKWARD_TAG_OFFSET",
]

Range = tuple[int, int]


class PartitionError(ValueError):
    """A layer cannot be split the requested way (tile smaller than its halo, or an extent smaller than its
    number of parts)."""


@dataclass(frozen=True)
class Window1d:
    """A sliding window along one dimension: output index ``o`` reads inputs
    ``o*stride - padding + dilation*t`` for ``t = 0..kernel-1`` (convolution and pooling).  ``ceil_mode``
    (pooling): the output count rounds up, so the last window may reach past the padded extent ``n + padding``
    (PyTorch's ``pooling_output_shape``: a window may not start beyond it).  ``padding_hi``: the padding after
    the last entry when it differs from ``padding`` (``padding='same'`` with an even kernel span: torch pads
    ``span // 2`` before and the rest after)."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    ceil_mode: bool = False
    padding_hi: int | None = None

    @property
    def pad_after(self) -> int:
        """The padding after the last entry."""
        return self.padding if self.padding_hi is None else self.padding_hi

    @property
    def symmetric(self) -> bool:
        return self.pad_after == self.padding

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        if not self.ceil_mode:
            return (n + self.padding + self.pad_after - self.span) // self.stride + 1
        out = -(-(n + 2 * self.padding - self.span) // self.stride) + 1
        # the last window must start inside the input or its left padding
        return out - 1 if (out - 1) * self.stride >= n + self.padding else out

    def needed(self, o0: int, o1: int, n: int) -> Range:
        """Global input range ``[lo, hi)`` read by outputs ``[o0, o1)``; may reach into the zero padding."""
        return o0 * self.stride - self.padding, (o1 - 1) * self.stride - self.padding + self.span

    def outputs_within(self, lo: int, hi: int) -> Range:
        """Outputs whose whole window lies inside input range ``[lo, hi)`` (used to find the interior)."""
        first = math.ceil((lo + self.padding) / self.stride)
        last = (hi - self.span + self.padding) // self.stride  # inclusive
        return first, last + 1


def intersect(a: Range, b: Range) -> Range:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (lo, lo)


class DimPlan:
    """Halo bookkeeping along one dimension of extent ``n`` split in ``parts`` blocks, for a layer whose output
    (extent ``n_out``, also blocked) at ``[o0, o1)`` needs input ``window.needed(o0, o1, n)``."""

    def __init__(self, n: int, n_out: int, parts: int, window, *, what: str = "H") -> None:
        if n < parts:
            raise PartitionError(f"{what}: input extent {n} is smaller than the {parts} parts it is split into")
        if n_out < parts:
            raise PartitionError(f"{what}: output extent {n_out} is smaller than the {parts} parts it is split into")
        self.n, self.n_out, self.parts = n, n_out, parts
        self.owns = block_bounds(n, parts)
        self.outs = block_bounds(n_out, parts)
        self.needs = [window.needed(o0, o1, n) for (o0, o1) in self.outs]
        # clamped to the real extent: what must come from some tile (the rest is zero padding)
        self.needs_clamped = [(max(lo, 0), min(hi, n)) for (lo, hi) in self.needs]
        for p, (lo, hi) in enumerate(self.needs_clamped):
            first = self.owns[p - 1][0] if p > 0 else 0
            last = self.owns[p + 1][1] if p + 1 < parts else n
            if lo < first or hi > last:
                raise PartitionError(
                    f"{what}: tile {p} of {parts} owns input entries {self.owns[p]} but its outputs {self.outs[p]} "
                    f"need {(lo, hi)}, beyond its neighbours' tiles (the tile is smaller than the halo it needs)"
                )

    def recv_range(self, p: int, delta: int) -> Range:
        """Entries tile ``p`` gets from tile ``p + delta`` (delta 0: the entries of its own it uses)."""
        return intersect(self.needs_clamped[p], self.owns[p + delta])

    def send_range(self, p: int, delta: int) -> Range:
        """Entries of tile ``p`` that tile ``p + delta`` needs."""
        return intersect(self.needs_clamped[p + delta], self.owns[p])


def _neighbors(grid: SpatialGrid) -> Iterator[tuple[int, ...]]:
    """Every ``delta`` in ``{-1, 0, 1}^k`` except 0 whose tile exists (no periodic wrap)."""
    for delta in itertools.product((-1, 0, 1), repeat=grid.ndim):
        if any(delta) and grid.neighbor(*delta) is not None:
            yield delta


class HaloPlan:
    """One layer call on this rank over the ``k = grid.ndim`` split dimensions (the tile's last ``k``): the owned
    tile, the needed (padded) input box, and the blocks to exchange with each of the up to ``3^k - 1``
    neighbours (faces, edges and corners: every block goes straight to the tile that needs it, so one round of
    messages suffices, section III-A).  ``dims`` holds one :class:`DimPlan` per split dimension, in order.

    A message is ``(peer, direction, range_0, ..., range_{k-1})``: the peer's global rank, the direction id of
    the message as its sender sees it (:func:`direction_id`, the tag offset both ends agree on) and the global
    range along each split dimension."""

    def __init__(self, grid: SpatialGrid, *dims: DimPlan) -> None:
        if len(dims) != grid.ndim:
            raise ValueError(f"HaloPlan: {len(dims)} dimension plans for a grid of {grid.ndim} split dimensions")
        self.grid, self.dims = grid, tuple(dims)
        idx = grid.index
        self.index = idx
        self.own = tuple(d.owns[i] for d, i in zip(dims, idx))
        self.out = tuple(d.outs[i] for d, i in zip(dims, idx))
        self.need = tuple(d.needs[i] for d, i in zip(dims, idx))
        self.need_clamped = tuple(d.needs_clamped[i] for d, i in zip(dims, idx))
        self.sends: list[tuple] = []  # (peer, direction id, *global ranges)
        self.recvs: list[tuple] = []
        #: what a kernel derives from the plan alone (e.g. the convolution's edge regions), kept with the plan
        self.memo: dict = {}
        for delta in _neighbors(grid):
            peer = grid.neighbor(*delta)
            assert peer is not None
            sent = tuple(d.send_range(i, e) for d, i, e in zip(dims, idx, delta))
            if all(hi > lo for lo, hi in sent):
                self.sends.append((peer, direction_id(delta), *sent))
            got = tuple(d.recv_range(i, e) for d, i, e in zip(dims, idx, delta))
            if all(hi > lo for lo, hi in got):
                self.recvs.append((peer, direction_id(tuple(-e for e in delta)), *got))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def local(self, ranges: Sequence[Range]) -> tuple[Any, ...]:
        """The index of this tile's part holding the global ``ranges`` of its split dimensions."""
        return trailing(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(ranges, self.own))


def trailing(slices: Iterable[Any]) -> tuple[Any, ...]:
    """An index selecting ``slices`` (or integers) of a tensor's last dimensions (``x[..., s_0, s_1]`` for any
    count)."""
    return (Ellipsis, *slices)


def direction_id(delta: Sequence[int]) -> int:
    """``0 .. 3^k - 1`` id of a message direction (``delta`` in ``{-1, 0, 1}^k``, base 3, first dimension most
    significant), as seen by its sender, so sender and receiver agree on the tag; below 27 for ``k <= 3``."""
    out = 0
    for e in delta:
        out = out * 3 + e + 1
    return out


def direction_delta(d: int, k: int) -> tuple[int, ...]:
    """The inverse of :func:`direction_id` for ``k`` dimensions."""
    out = []
    for _ in range(k):
        d, r = divmod(d, 3)
        out.append(r - 1)
    return tuple(reversed(out))


#: tag offset of the backward (gradient) messages of an exchange: above every forward direction id (3^3)
BACKWARD_TAG_OFFSET = 27


class HaloExchange:
    """One exchange of one layer call: posts the sends/receives, hands out the received halo blocks, and does
    the reverse (gradient) exchange in backward.  ``plan`` gives the blocks; tags are fresh per exchange
    (forward: base + direction id; backward: base + :data:`BACKWARD_TAG_OFFSET` + direction id)."""

    def __init__(self, plan: HaloPlan) -> None:
        self.plan = plan
        self.tag = plan.grid.next_tag()
        self._works: list = []
        self._recv_bufs: list[torch.Tensor] = []
        self._send_bufs: list[torch.Tensor] = []
        self._meta: list[tuple] = []
        self._backward_posted = True
        self.local_shape: torch.Size | None = None

    def wait(self) -> None:
        """Complete the messages posted so far (the received blocks stay for :meth:`finish_backward`)."""
        for w in self._works:
            w.wait()
        self._works = []

    def _buffer(self, like: torch.Tensor | torch.Size, ranges: Sequence[Range], dtype, device) -> torch.Tensor:
        lead = tuple(like)[: len(like) - self.plan.ndim]
        return torch.empty(*lead, *(hi - lo for lo, hi in ranges), dtype=dtype, device=device)

    def _post(self, tag: int, sends: list[tuple], recvs: list[tuple]) -> None:
        """Post ``(buffer, peer, direction id)`` sends and receives, one message per peer and direction, tagged
        ``tag`` + direction id, as one batch (NCCL-safe)."""
        self._send_bufs, self._recv_bufs = [b for b, _, _ in sends], [b for b, _, _ in recvs]
        self._works = exchange([(b, peer, tag + d) for b, peer, d in sends],
                               [(b, peer, tag + d) for b, peer, d in recvs], self.plan.grid.group)

    # -- forward -------------------------------------------------------------------------------------------
    def post_forward(self, x: torch.Tensor) -> None:
        self.local_shape = x.shape
        self._xmeta = (x.dtype, x.device)
        plan = self.plan
        recvs = [(self._buffer(x.shape, ranges, x.dtype, x.device), peer, d) for peer, d, *ranges in plan.recvs]
        sends = [(x[plan.local(ranges)].contiguous(), peer, d) for peer, d, *ranges in plan.sends]
        self._post(self.tag, sends, recvs)

    def finish_forward(self) -> list[torch.Tensor]:
        """Wait for the halos; the received blocks, in ``plan.recvs`` order."""
        self.wait()
        bufs = self._recv_bufs
        self._meta = [(b.shape, b.dtype, b.device) for b in bufs]
        self._recv_bufs, self._send_bufs = [], []
        self._backward_posted = False
        return bufs

    # -- backward (the adjoint) -----------------------------------------------------------------------------
    def post_backward(self, grads: list[torch.Tensor | None]) -> None:
        """Send the gradient of each received halo block back to its owner; post receives for ours."""
        plan = self.plan
        self._backward_posted = True
        sends = [(torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous(), peer, d)
                 for (peer, d, *_), g, (shape, dtype, device) in zip(plan.recvs, grads, self._meta)]
        assert self.local_shape is not None
        dtype, device = self._xmeta
        recvs = [(self._buffer(self.local_shape, ranges, dtype, device), peer, d) for peer, d, *ranges in plan.sends]
        self._post(self.tag + BACKWARD_TAG_OFFSET, sends, recvs)

    def finish_backward(self, grad: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """Add the halo gradients our neighbours computed for the entries we own into the tile's gradient
        (``inplace``: into ``grad`` itself, which the caller owns)."""
        if not self._backward_posted:
            # no received block was used on this rank: their gradient is zero, but the neighbours expect it
            self.post_backward([None] * len(self.plan.recvs))
        if not self._works and not self._recv_bufs:
            return grad
        self.wait()
        if self._recv_bufs:
            if not inplace:
                grad = grad.clone()
            for (_, _, *ranges), buf in zip(self.plan.sends, self._recv_bufs):
                grad[self.plan.local(ranges)] += buf.to(grad.dtype)
        self._recv_bufs, self._send_bufs = [], []
        return grad


class _HaloStart(torch.autograd.Function):
    """Identity that posts the exchange; its backward (which runs after every use of the tile) adds the
    received halo gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:  # type: ignore[override]
        refuse_trace('a halo exchange (eager form)')
        exchange.post_forward(x)
        ctx.exchange = exchange
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.finish_backward(grad), None


class _HaloFinish(torch.autograd.Function):
    """Waits for the halos and returns the received blocks; backward sends their gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: HaloExchange):  # type: ignore[override]
        refuse_trace('a halo exchange (eager form)')
        ctx.exchange = exchange
        bufs = exchange.finish_forward()
        return (x.view_as(x), *bufs)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_x, *grads):  # type: ignore[override]
        ctx.exchange.post_backward(list(grads))
        return grad_x, None


class Halo:
    """A tile plus its received halo blocks (``bufs``, in ``plan.recvs`` order, as
    :meth:`HaloExchange.finish_forward` gives them); :meth:`box` assembles any global input box from them."""

    def __init__(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], plan: HaloPlan) -> None:
        self.x, self.plan = x, plan
        #: the received blocks and their global ranges, keyed by the ``delta`` of the tile they come from
        self.blocks: dict[tuple[int, ...], tuple[torch.Tensor, tuple[Range, ...]]] = {}
        for (_, d, *ranges), buf in zip(plan.recvs, bufs):
            # a received message carries its sender's direction: the sender lies at minus that
            self.blocks[tuple(-e for e in direction_delta(d, plan.ndim))] = (buf, tuple(ranges))

    def box(self, *bounds: int, pad_value: float = 0.0, own_zero: bool = False) -> torch.Tensor:
        """The input box ``[lo_0, hi_0) x [lo_1, hi_1) x ...`` over the split dimensions, ``bounds`` given flat as
        ``lo_0, hi_0, lo_1, hi_1, ...`` (global; outside the sample: ``pad_value``).  ``own_zero``: zeros in place
        of the tile's part (only the received halo and the padding).  Assembled from the (up to ``3^k``) pieces
        by concatenation along the last dimension first, then padded: autograd flows to the tile and to each
        received block."""
        plan = self.plan
        k = plan.ndim
        if len(bounds) != 2 * k:
            raise ValueError(f"Halo.box: {len(bounds)} bounds for {k} split dimensions (expected lo, hi per dimension)")
        want = [(bounds[2 * e], bounds[2 * e + 1]) for e in range(k)]
        clamped, pads = _clamped(want, plan.dims)
        if any(chi <= clo for clo, chi in clamped):  # nothing of the sample inside the box: padding only
            shape = (*self.x.shape[: self.x.dim() - k], *(hi - lo for lo, hi in want))
            return self.x.new_full(shape, pad_value)

        def piece(delta: tuple[int, ...]) -> torch.Tensor | None:
            if not any(delta):
                src, ranges = self.x, plan.own
            elif delta in self.blocks:
                src, ranges = self.blocks[delta]
            else:
                return None
            cut = [intersect(r, c) for r, c in zip(ranges, clamped)]
            if any(b <= a for a, b in cut):
                return None
            if not any(delta) and own_zero:
                return src.new_zeros(*src.shape[: src.dim() - k], *(b - a for a, b in cut))
            return src[trailing(slice(a - r[0], b - r[0]) for (a, b), r in zip(cut, ranges))]

        def assemble(prefix: tuple[int, ...]) -> torch.Tensor | None:
            if len(prefix) == k:
                return piece(prefix)
            parts = [p for e in (-1, 0, 1) if (p := assemble((*prefix, e))) is not None]
            if not parts:
                return None
            return torch.cat(parts, dim=len(prefix) - k) if len(parts) > 1 else parts[0]

        out = assemble(())
        assert out is not None  # the clamped box is non-empty, so some tile holds part of it
        if any(pads):
            out = F.pad(out, pads, value=pad_value)
        return out


def _clamped(want: Sequence[Range], dims: Sequence[Any]) -> tuple[list[Range], list[int]]:
    """A box's global ranges clamped to the sample (``dims[e].n`` entries along split dimension ``e``), and the
    padding outside it in ``F.pad``'s order (the last dimension first, low then high)."""
    clamped = [(max(lo, 0), min(hi, dim.n)) for (lo, hi), dim in zip(want, dims)]
    pads: list[int] = []
    for (lo, hi), (clo, chi) in zip(reversed(want), reversed(clamped)):
        pads += [clo - lo, hi - chi]
    return clamped, pads


def _local_box(plan: HaloPlan) -> tuple[Any, list[int] | None]:
    """For a plan that exchanges nothing: the index of the tile's part of the box ``plan.need`` (None: the whole
    tile) and the padding around it (None: none), as :meth:`Halo.box` cuts them (made once per plan)."""
    memo = plan.memo.get("local_box")
    if memo is None:
        clamped, pads = _clamped(plan.need, plan.dims)
        if [tuple(c) for c in clamped] != [tuple(o) for o in plan.own]:
            index = trailing(slice(a - r[0], b - r[0]) for (a, b), r in zip(clamped, plan.own))
        else:
            index = None
        memo = plan.memo["local_box"] = (index, pads if any(pads) else None)
    return memo  # type: ignore[no-any-return]


def halo_exchange(x: torch.Tensor, plan: HaloPlan, *, pad_value: float = 0.0) -> torch.Tensor:
    """Blocking halo exchange: the tile extended to the box ``plan.need`` (halo from neighbours, ``pad_value``
    outside the sample), autograd-tracked through the exchange (:class:`_HaloStart`, :class:`_HaloFinish`)."""
    if not plan.sends and not plan.recvs:  # nothing to exchange: the tag advances as an exchange's would
        plan.grid.next_tag()
        index, pads = _local_box(plan)
        out = x if index is None else x[index]
        return F.pad(out, pads, value=pad_value) if pads else out
    if Trace.active:  # the exchange as an operator a graph holds, with its adjoint (graph_ops.halo_box)
        return torch.ops.lightning_hpc.halo_box(x, key_of(plan), [0] * plan.ndim, float(pad_value))  # type: ignore[no-any-return]
    exchange = HaloExchange(plan)
    x, *bufs = _HaloFinish.apply(_HaloStart.apply(x, exchange), exchange)
    return Halo(x, bufs, plan).box(*(b for r in plan.need for b in r), pad_value=pad_value)

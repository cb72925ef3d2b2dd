"""Halo exchange over a blocked H x W partition (Dryden et al., section III-A; overlap per section IV-A).

A layer whose output tile needs input rows/columns held by neighbouring tiles (convolution, pooling,
interpolation) describes, per spatial dimension, which global input range an output range needs
(:class:`Window1d` for sliding windows).  :class:`DimPlan` turns that into, for every tile, the rows it owns,
the rows its output needs and therefore exactly which rows it must receive from / send to each neighbour:
nothing at all for 1x1 stride-1 kernels, ``O = floor(K/2) * dilation`` rows for "same" convolutions, and the
asymmetric ranges strided kernels need when output tiles are re-blocked.  The 8-neighbour exchange sends the
corner blocks directly, so both dimensions are exchanged in one round and can be overlapped with the
interior computation.

Autograd: the exchange is split into :class:`_HaloStart` (identity; forward posts the sends/receives) and
:class:`_HaloFinish` (forward waits and assembles the extended tile).  Backward runs in the reverse order:
``_HaloFinish.backward`` keeps the gradient of the owned rows and posts the halo gradients back to their
owners; ``_HaloStart.backward`` runs once every other use of the tile has produced its gradient (the interior
convolution's backward in between overlaps the exchange) and adds the received halo gradients into the
interior.  This is the adjoint of the forward exchange (tested with a dot-product test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.strategies.spatial.tiling import SpatialGrid

__all__ = [
    "Window1d",
    "PartitionError",
    "DimPlan",
    "HaloPlan",
    "HaloExchange",
    "halo_exchange",
    "start_halo_exchange",
    "finish_halo_exchange",
]

Range = tuple[int, int]


class PartitionError(ValueError):
    """A layer cannot be split the requested way (tile smaller than its halo, or fewer rows than parts)."""


@dataclass(frozen=True)
class Window1d:
    """A sliding window along one dimension: output index ``o`` reads inputs
    ``o*stride - padding + dilation*t`` for ``t = 0..kernel-1`` (convolution and pooling, ceil_mode=False)."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        return (n + 2 * self.padding - self.span) // self.stride + 1

    def needed(self, o0: int, o1: int, n: int) -> Range:
        """Global input range ``[lo, hi)`` read by outputs ``[o0, o1)``; may reach into the zero padding."""
        return o0 * self.stride - self.padding, (o1 - 1) * self.stride - self.padding + self.span

    def outputs_within(self, lo: int, hi: int) -> Range:
        """Outputs whose whole window lies inside input range ``[lo, hi)`` (used to find the interior)."""
        first = math.ceil((lo + self.padding) / self.stride)
        last = (hi - self.span + self.padding) // self.stride  # inclusive
        return first, last + 1


def _intersect(a: Range, b: Range) -> Range:
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
                    f"{what}: tile {p} of {parts} owns input rows {self.owns[p]} but its output rows {self.outs[p]} "
                    f"need {(lo, hi)}, beyond its neighbours' tiles (the tile is smaller than the halo it needs)"
                )

    def recv_range(self, p: int, delta: int) -> Range:
        """Rows tile ``p`` gets from tile ``p + delta`` (delta 0: the rows of its own it uses)."""
        return _intersect(self.needs_clamped[p], self.owns[p + delta])

    def send_range(self, p: int, delta: int) -> Range:
        """Rows of tile ``p`` that tile ``p + delta`` needs."""
        return _intersect(self.needs_clamped[p + delta], self.owns[p])

    def halo_size(self, p: int) -> int:
        """Rows tile ``p`` receives (for the performance model and the tests)."""
        return sum(e - s for d in (-1, 1) if 0 <= p + d < self.parts for (s, e) in [self.recv_range(p, d)])


def _neighbors(grid: SpatialGrid):
    for di in (-1, 0, 1):
        for dj in (-1, 0, 1):
            if (di, dj) != (0, 0) and grid.neighbor(di, dj) is not None:
                yield di, dj


class HaloPlan:
    """Both dimensions of one layer call on this rank: owned tile, needed (padded) input box, and the blocks to
    exchange with each of the up to 8 neighbours."""

    def __init__(self, grid: SpatialGrid, rows: DimPlan, cols: DimPlan) -> None:
        self.grid, self.rows, self.cols = grid, rows, cols
        i, j = grid.index
        self.i, self.j = i, j
        self.own = (rows.owns[i], cols.owns[j])
        self.out = (rows.outs[i], cols.outs[j])
        self.need = (rows.needs[i], cols.needs[j])
        self.need_clamped = (rows.needs_clamped[i], cols.needs_clamped[j])
        self.sends: list[tuple[int, int, Range, Range]] = []  # (peer, direction id, rows, cols), tile-local
        self.recvs: list[tuple[int, int, Range, Range]] = []
        for di, dj in _neighbors(grid):
            peer = grid.neighbor(di, dj)
            assert peer is not None
            sr, sc = rows.send_range(i, di), cols.send_range(j, dj)
            if sr[1] > sr[0] and sc[1] > sc[0]:
                self.sends.append((peer, _direction(di, dj), sr, sc))
            rr, rc = rows.recv_range(i, di), cols.recv_range(j, dj)
            if rr[1] > rr[0] and rc[1] > rc[0]:
                self.recvs.append((peer, _direction(-di, -dj), rr, rc))

    @property
    def pads(self) -> tuple[int, int, int, int]:
        """Zero padding (left, right, top, bottom) that completes the clamped box to the needed box."""
        (rlo, rhi), (clo, chi) = self.need
        (crlo, crhi), (cclo, cchi) = self.need_clamped
        return cclo - clo, chi - cchi, crlo - rlo, rhi - crhi

    @property
    def communicates(self) -> bool:
        return bool(self.sends or self.recvs)


def _direction(di: int, dj: int) -> int:
    """0..8 id of a message direction as seen by its sender (so sender and receiver agree on the tag)."""
    return (di + 1) * 3 + (dj + 1)


class HaloExchange:
    """One exchange of one layer call: posts the sends/receives, assembles the extended tile, and does the
    reverse (gradient) exchange in backward.  ``plan`` gives the blocks; tags are fresh per exchange."""

    def __init__(self, plan: HaloPlan) -> None:
        self.plan = plan
        self.tag = plan.grid.next_tag()
        self._works: list = []
        self._recv_bufs: list[torch.Tensor] = []
        self._send_bufs: list[torch.Tensor] = []
        self.local_shape: torch.Size | None = None

    # -- forward -------------------------------------------------------------------------------------------
    def _local(self, r: Range, c: Range) -> tuple[slice, slice]:
        (a, _), (b, _) = self.plan.own
        return slice(r[0] - a, r[1] - a), slice(c[0] - b, c[1] - b)

    def post_forward(self, x: torch.Tensor) -> None:
        self.local_shape = x.shape
        group = self.plan.grid.group
        self._send_bufs = []
        self._recv_bufs = []
        self._works = []
        for peer, d, r, c in self.plan.recvs:
            buf = x.new_empty(x.shape[0], x.shape[1], r[1] - r[0], c[1] - c[0])
            self._recv_bufs.append(buf)
            self._works.append(dist.irecv(buf, src=peer, group=group, tag=self.tag + d))
        for peer, d, r, c in self.plan.sends:
            rs, cs = self._local(r, c)
            buf = x[:, :, rs, cs].contiguous()
            self._send_bufs.append(buf)
            self._works.append(dist.isend(buf, dst=peer, group=group, tag=self.tag + d))

    def _wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []

    def finish_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Wait for the halos and assemble the tile extended to the clamped needed box."""
        self._wait()
        blocks = {(d_r, d_c): None for d_r in (-1, 0, 1) for d_c in (-1, 0, 1)}
        i, j = self.plan.i, self.plan.j
        for (peer, d, r, c), buf in zip(self.plan.recvs, self._recv_bufs):
            di, dj = divmod(8 - d, 3)  # recvs store the sender's direction (-di, -dj)
            blocks[(di - 1, dj - 1)] = buf
        rows, cols = self.plan.rows, self.plan.cols
        rs, cs = self._local(rows.recv_range(i, 0), cols.recv_range(j, 0))
        blocks[(0, 0)] = x[:, :, rs, cs]
        bands = []
        for di in (-1, 0, 1):
            parts = [blocks[(di, dj)] for dj in (-1, 0, 1) if blocks[(di, dj)] is not None]
            parts = [p for p in parts if p.shape[2] > 0 and p.shape[3] > 0]
            if parts:
                bands.append(torch.cat(parts, dim=3) if len(parts) > 1 else parts[0])
        self._recv_bufs = []
        self._send_bufs = []
        ext = torch.cat(bands, dim=2) if len(bands) > 1 else bands[0]
        self._ext_meta = (ext.shape, ext.dtype, ext.device)
        self._backward_posted = False
        return ext

    # -- backward (the adjoint) -----------------------------------------------------------------------------
    def post_backward(self, grad_ext: torch.Tensor) -> torch.Tensor:
        """Split the extended-tile gradient: keep the owned part, send each halo part back to its owner."""
        plan, group = self.plan, self.plan.grid.group
        self._backward_posted = True
        (crlo, _), (cclo, _) = plan.need_clamped
        assert self.local_shape is not None
        grad = grad_ext.new_zeros(self.local_shape)
        i, j = plan.i, plan.j
        r0, c0 = plan.rows.recv_range(i, 0), plan.cols.recv_range(j, 0)
        ls = self._local(r0, c0)
        grad[:, :, ls[0], ls[1]] = grad_ext[:, :, r0[0] - crlo : r0[1] - crlo, c0[0] - cclo : c0[1] - cclo]
        self._works, self._send_bufs, self._recv_bufs = [], [], []
        # the halo blocks we received in forward go back to their senders (reverse direction tags)
        for peer, d, r, c in plan.recvs:
            buf = grad_ext[:, :, r[0] - crlo : r[1] - crlo, c[0] - cclo : c[1] - cclo].contiguous()
            self._send_bufs.append(buf)
            self._works.append(dist.isend(buf, dst=peer, group=group, tag=self.tag + 9 + d))
        for peer, d, r, c in plan.sends:
            buf = grad_ext.new_empty(grad_ext.shape[0], grad_ext.shape[1], r[1] - r[0], c[1] - c[0])
            self._recv_bufs.append(buf)
            self._works.append(dist.irecv(buf, src=peer, group=group, tag=self.tag + 9 + d))
        return grad

    def finish_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Add the halo gradients our neighbours computed for rows we own into the interior gradient."""
        if not getattr(self, "_backward_posted", True):
            # the extended tile was not used on this rank (its whole output was interior): its halo gradient is
            # zero, but the neighbours still expect it and still send theirs
            shape, dtype, device = self._ext_meta
            self.post_backward(torch.zeros(shape, dtype=dtype, device=device))
        if not self._works and not self._recv_bufs:
            return grad
        self._wait()
        grad = grad.clone()
        for (peer, d, r, c), buf in zip(self.plan.sends, self._recv_bufs):
            rs, cs = self._local(r, c)
            grad[:, :, rs, cs] += buf
        self._recv_bufs, self._send_bufs = [], []
        return grad


class _HaloStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:  # type: ignore[override]
        exchange.post_forward(x)
        ctx.exchange = exchange
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.finish_backward(grad), None


class _HaloFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.finish_forward(x)

    @staticmethod
    def backward(ctx, grad_ext: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.post_backward(grad_ext.contiguous()), None


def start_halo_exchange(x: torch.Tensor, plan: HaloPlan) -> tuple[torch.Tensor, HaloExchange]:
    """Post the halo sends/receives of ``x``; returns ``x`` (tracked) and the exchange to finish later."""
    exchange = HaloExchange(plan)
    return _HaloStart.apply(x, exchange), exchange


def finish_halo_exchange(x_started: torch.Tensor, exchange: HaloExchange, *, pad_value: float = 0.0) -> torch.Tensor:
    """Wait for the halos; return the tile extended to the needed box, with ``pad_value`` outside the image."""
    ext = _HaloFinish.apply(x_started, exchange)
    pads = exchange.plan.pads
    if any(pads):
        ext = F.pad(ext, pads, value=pad_value)
    return ext


def halo_exchange(x: torch.Tensor, plan: HaloPlan, *, pad_value: float = 0.0) -> torch.Tensor:
    """Blocking halo exchange: the tile extended to the box ``plan.need`` (halo from neighbours, padding
    outside the image)."""
    xs, ex = start_halo_exchange(x, plan)
    return finish_halo_exchange(xs, ex, pad_value=pad_value)

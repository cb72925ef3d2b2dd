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
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lightning_hpc.distributed.p2p import exchange
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = [
    "Window1d",
    "PartitionError",
    "DimPlan",
    "HaloPlan",
    "HaloExchange",
    "Halo",
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
    ``o*stride - padding + dilation*t`` for ``t = 0..kernel-1`` (convolution and pooling).  ``ceil_mode``
    (pooling): the output count rounds up, so the last window may reach past the padded extent ``n + padding``
    (PyTorch's ``pooling_output_shape``: a window may not start beyond it)."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    ceil_mode: bool = False

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        if not self.ceil_mode:
            return (n + 2 * self.padding - self.span) // self.stride + 1
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
    """One exchange of one layer call: posts the sends/receives, hands out the received halo blocks, and does
    the reverse (gradient) exchange in backward.  ``plan`` gives the blocks; tags are fresh per exchange."""

    def __init__(self, plan: HaloPlan) -> None:
        self.plan = plan
        self.tag = plan.grid.next_tag()
        self._works: list = []
        self._recv_bufs: list[torch.Tensor] = []
        self._send_bufs: list[torch.Tensor] = []
        self._meta: list[tuple] = []
        self._backward_posted = True
        self.local_shape: torch.Size | None = None

    def _local(self, r: Range, c: Range) -> tuple[slice, slice]:
        (a, _), (b, _) = self.plan.own
        return slice(r[0] - a, r[1] - a), slice(c[0] - b, c[1] - b)

    def _wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []

    # -- forward -------------------------------------------------------------------------------------------
    def post_forward(self, x: torch.Tensor) -> None:
        self.local_shape = x.shape
        self._xmeta = (x.dtype, x.device)
        group = self.plan.grid.group
        self._send_bufs, self._recv_bufs = [], []
        # one message per peer and direction, tagged by direction; posted as one batch (NCCL-safe)
        recvs, sends, tag = [], [], self.tag
        for peer, d, r, c in self.plan.recvs:
            buf = x.new_empty(x.shape[0], x.shape[1], r[1] - r[0], c[1] - c[0])
            self._recv_bufs.append(buf)
            recvs.append((buf, peer, tag + d))
        for peer, d, r, c in self.plan.sends:
            rs, cs = self._local(r, c)
            buf = x[:, :, rs, cs].contiguous()
            self._send_bufs.append(buf)
            sends.append((buf, peer, tag + d))
        self._works = exchange(sends, recvs, group)

    def finish_forward(self) -> list[torch.Tensor]:
        """Wait for the halos; the received blocks, in ``plan.recvs`` order."""
        self._wait()
        bufs = self._recv_bufs
        self._meta = [(b.shape, b.dtype, b.device) for b in bufs]
        self._recv_bufs, self._send_bufs = [], []
        self._backward_posted = False
        return bufs

    # -- backward (the adjoint) -----------------------------------------------------------------------------
    def post_backward(self, grads: list[torch.Tensor | None]) -> None:
        """Send the gradient of each received halo block back to its owner; post receives for ours."""
        plan, group = self.plan, self.plan.grid.group
        self._backward_posted = True
        self._send_bufs, self._recv_bufs = [], []
        recvs, sends, tag = [], [], self.tag + 9
        for (peer, d, r, c), g, (shape, dtype, device) in zip(plan.recvs, grads, self._meta):
            buf = torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
            self._send_bufs.append(buf)
            sends.append((buf, peer, tag + d))
        assert self.local_shape is not None
        n, ch = self.local_shape[0], self.local_shape[1]
        for peer, d, r, c in plan.sends:
            dtype, device = self._xmeta
            buf = torch.empty(n, ch, r[1] - r[0], c[1] - c[0], dtype=dtype, device=device)
            self._recv_bufs.append(buf)
            recvs.append((buf, peer, tag + d))
        self._works = exchange(sends, recvs, group)

    def wait(self) -> None:
        """Complete the messages posted so far (the received blocks stay for :meth:`finish_backward`)."""
        self._wait()

    def finish_backward(self, grad: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """Add the halo gradients our neighbours computed for rows we own into the interior gradient
        (``inplace``: into ``grad`` itself, which the caller owns)."""
        if not self._backward_posted:
            # no received block was used on this rank: their gradient is zero, but the neighbours expect it
            self.post_backward([None] * len(self.plan.recvs))
        if not self._works and not self._recv_bufs:
            return grad
        self._wait()
        if self._recv_bufs:
            if not inplace:
                grad = grad.clone()
            for (peer, d, r, c), buf in zip(self.plan.sends, self._recv_bufs):
                rs, cs = self._local(r, c)
                grad[:, :, rs, cs] += buf.to(grad.dtype)
        self._recv_bufs, self._send_bufs = [], []
        return grad


class _HaloStart(torch.autograd.Function):
    """Identity that posts the exchange; its backward (which runs after every use of the tile) adds the
    received halo gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: HaloExchange) -> torch.Tensor:  # type: ignore[override]
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
        ctx.exchange = exchange
        bufs = exchange.finish_forward()
        return (x.view_as(x), *bufs)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, grad_x, *grads):  # type: ignore[override]
        ctx.exchange.post_backward(list(grads))
        return grad_x, None


class Halo:
    """A tile plus its received halo blocks; :meth:`box` assembles any global input box from them."""

    def __init__(
        self, x: torch.Tensor, blocks: dict[tuple[int, int], tuple[torch.Tensor, Range, Range]], plan: HaloPlan
    ) -> None:
        self.x, self.blocks, self.plan = x, blocks, plan

    @classmethod
    def from_blocks(cls, x: torch.Tensor, bufs: list[torch.Tensor], plan: HaloPlan) -> Halo:
        """The tile and its received blocks (in ``plan.recvs`` order, as :meth:`HaloExchange.finish_forward` gives
        them)."""
        blocks = {}
        for (peer, d, r, c), buf in zip(plan.recvs, bufs):
            di, dj = divmod(8 - d, 3)  # recvs store the sender's direction (-di, -dj)
            blocks[(di - 1, dj - 1)] = (buf, r, c)
        return cls(x, blocks, plan)

    def box(self, r0: int, r1: int, c0: int, c1: int, pad_value: float = 0.0, own: torch.Tensor | None = None,
            own_zero: bool = False) -> torch.Tensor:
        """Input rows ``[r0, r1)`` x columns ``[c0, c1)`` (global; outside the image: ``pad_value``).  ``own``:
        the part of the box inside this tile when the caller already sliced it (see :func:`own_slices`);
        ``own_zero``: zeros in place of the tile's part (only the received halo and the padding)."""
        plan = self.plan
        n_h, n_w = plan.rows.n, plan.cols.n
        cr0, cr1, cc0, cc1 = max(r0, 0), min(r1, n_h), max(c0, 0), min(c1, n_w)
        bands = []
        for di in (-1, 0, 1):
            row_parts = []
            for dj in (-1, 0, 1):
                if (di, dj) == (0, 0):
                    src, rr, cc = self.x, plan.own[0], plan.own[1]
                elif (di, dj) in self.blocks:
                    src, rr, cc = self.blocks[(di, dj)]
                else:
                    continue
                (ra, rb), (ca, cb) = _intersect(rr, (cr0, cr1)), _intersect(cc, (cc0, cc1))
                if rb > ra and cb > ca:
                    if (di, dj) == (0, 0) and own_zero:
                        row_parts.append(src.new_zeros(src.shape[0], src.shape[1], rb - ra, cb - ca))
                    elif (di, dj) == (0, 0) and own is not None:
                        row_parts.append(own)
                    else:
                        row_parts.append(src[:, :, ra - rr[0] : rb - rr[0], ca - cc[0] : cb - cc[0]])
            if row_parts:
                bands.append(torch.cat(row_parts, dim=3) if len(row_parts) > 1 else row_parts[0])
        out = torch.cat(bands, dim=2) if len(bands) > 1 else bands[0]
        pads = (cc0 - c0, c1 - cc1, cr0 - r0, r1 - cr1)
        if any(pads):
            out = F.pad(out, pads, value=pad_value)
        return out


class _OwnSlices(torch.autograd.Function):
    """Several slices (views, no copy) of one tile; backward accumulates their gradients into ONE tile-sized
    buffer, where separate slicing would allocate a zero-filled tile per slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, boxes: list[tuple[int, int, int, int]]):  # type: ignore[override]
        ctx.shape, ctx.boxes = x.shape, boxes
        return tuple(x[:, :, r0:r1, c0:c1] for (r0, r1, c0, c1) in boxes)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, *grads):  # type: ignore[override]
        out = None
        for (r0, r1, c0, c1), g in zip(ctx.boxes, grads):
            if g is None:
                continue
            if out is None:
                out = g.new_zeros(ctx.shape)
            out[:, :, r0:r1, c0:c1] += g
        return out, None


def own_slices(x: torch.Tensor, plan: HaloPlan, boxes: list[tuple[int, int, int, int]]) -> list[torch.Tensor | None]:
    """For global input boxes ``(r0, r1, c0, c1)``, the part of each inside this rank's tile (``None`` if
    empty), taken through one autograd node."""
    (a, b), (c, e) = plan.own
    local: list[tuple[int, int, int, int]] = []
    keep: list[int | None] = []
    for r0, r1, c0, c1 in boxes:
        ra, rb, ca, cb = max(r0, a), min(r1, b), max(c0, c), min(c1, e)
        if rb > ra and cb > ca:
            keep.append(len(local))
            local.append((ra - a, rb - a, ca - c, cb - c))
        else:
            keep.append(None)
    views = _OwnSlices.apply(x, local) if local else ()
    return [views[k] if k is not None else None for k in keep]


def start_halo_exchange(x: torch.Tensor, plan: HaloPlan) -> tuple[torch.Tensor, HaloExchange]:
    """Post the halo sends/receives of ``x``; returns ``x`` (tracked) and the exchange to finish later."""
    exchange = HaloExchange(plan)
    return _HaloStart.apply(x, exchange), exchange


def finish_halo_exchange(x_started: torch.Tensor, exchange: HaloExchange) -> Halo:
    """Wait for the halos; returns the tile with its received blocks (autograd-tracked)."""
    out = _HaloFinish.apply(x_started, exchange)
    x, bufs = out[0], out[1:]
    return Halo.from_blocks(x, list(bufs), exchange.plan)


def halo_exchange(x: torch.Tensor, plan: HaloPlan, *, pad_value: float = 0.0) -> torch.Tensor:
    """Blocking halo exchange: the tile extended to the box ``plan.need`` (halo from neighbours, ``pad_value``
    outside the image)."""
    xs, ex = start_halo_exchange(x, plan)
    (r0, r1), (c0, c1) = plan.need
    return finish_halo_exchange(xs, ex).box(r0, r1, c0, c1, pad_value)

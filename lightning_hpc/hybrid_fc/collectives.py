"""Counted torch.distributed collectives on uneven blocks, the building blocks of the hybrid head.

Every collective the head issues goes through :class:`HeadComm`, which (1) pads uneven blocks to the largest
block (gloo and NCCL all-gather / reduce-scatter need equal chunks), (2) works along any dimension (rows =
examples, columns = neurons), and (3) adds the bytes it moves to a :class:`ByteCounter`, so the benchmark counts
communication at the collectives rather than estimating it.

Byte convention (per rank, averaged over ranks by the benchmark): the bytes this rank *receives* under the
standard algorithms - ring all-reduce ``2 (K-1)/K n``, all-gather ``total - own``, reduce-scatter ``(K-1)/K n``,
all-to-all the off-rank blocks received, broadcast/scatter ``n`` on each non-root, reduce/gather ``n`` sent by each
non-root (so the total over ranks is the traffic on the wire).  Padding is counted: it is sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpc._compat import all_gather_single, reduce_scatter_single

__all__ = ["ByteCounter", "HeadComm", "pad_dim", "allreduce_ring_bytes"]


@dataclass
class ByteCounter:
    """Bytes and calls per collective kind; ``reset()`` between steps, ``total`` for the step."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    @property
    def total(self) -> int:
        return int(sum(self.bytes.values()))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


def allreduce_ring_bytes(numel: int, element_size: int, k: int) -> float:
    """Bytes each rank receives in a ring all-reduce of ``numel`` elements."""
    return 2 * (k - 1) / k * numel * element_size if k > 1 else 0.0


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` up to ``size``."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return F.pad(x, pad)


class _Pending:
    """An asynchronous collective plus the post-processing that makes its result usable."""

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor]) -> None:
        self._work, self._finish, self._done = work, finish, False
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done = True
        assert self._result is not None  # set by finish() above
        return self._result


class HeadComm:
    """The process group of the K model-parallel ranks plus a byte counter.

    ``group=None`` is the default (world) group.  All methods must be called by every rank of the group in the
    same order (they are collectives).  Blocks are given as a list of sizes, one per rank, along ``dim``.
    """

    def __init__(self, group: Any = None, counter: ByteCounter | None = None) -> None:
        self.group = group
        self.counter = counter if counter is not None else ByteCounter()
        self.k = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (torch.distributed's src/dst are global ranks)."""
        if self.group is None or not dist.is_initialized():
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- all-gather / reduce-scatter along a dimension, uneven blocks --------------------------------------
    def all_gather(self, x: torch.Tensor, sizes: Sequence[int], dim: int, async_op: bool = False) -> Any:
        """Concatenate every rank's block along ``dim`` (block ``r`` has ``sizes[r]`` entries)."""
        if self.k == 1:
            return _Pending(None, lambda: x) if async_op else x
        m = max(sizes)
        xm = pad_dim(x, dim, m).movedim(dim, 0).contiguous()
        out = torch.empty((self.k * m, *xm.shape[1:]), dtype=x.dtype, device=x.device)
        self.counter.add("all_gather", (self.k - 1) * xm.numel() * xm.element_size())
        work = all_gather_single(out, xm, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            parts = [out[r * m : r * m + s] for r, s in enumerate(sizes)]
            return torch.cat(parts, 0).movedim(0, dim)

        pending = _Pending(work, finish)
        return pending if async_op else pending.wait()

    def reduce_scatter(self, x: torch.Tensor, sizes: Sequence[int], dim: int, async_op: bool = False) -> Any:
        """Sum ``x`` over ranks and keep this rank's block along ``dim``."""
        if self.k == 1:
            return _Pending(None, lambda: x) if async_op else x
        m = max(sizes)
        blocks = torch.split(x.movedim(dim, 0), list(sizes), 0)
        xin = torch.cat([pad_dim(b, 0, m) for b in blocks], 0).contiguous()
        out = torch.empty((m, *xin.shape[1:]), dtype=x.dtype, device=x.device)
        self.counter.add("reduce_scatter", (self.k - 1) * out.numel() * out.element_size())
        work = reduce_scatter_single(out, xin, group=self.group, async_op=True)
        mine = sizes[self.rank]
        pending = _Pending(work, lambda: out[:mine].movedim(0, dim))
        return pending if async_op else pending.wait()

    # -- all-to-all of blocks between two dimensions -------------------------------------------------------
    def all_to_all(
        self, x: torch.Tensor, split_dim: int, split_sizes: Sequence[int], cat_dim: int, cat_sizes: Sequence[int]
    ) -> torch.Tensor:
        """Send block ``r`` of ``x`` along ``split_dim`` (sizes ``split_sizes``) to rank ``r`` and concatenate the
        blocks received along ``cat_dim``.

        ``x``'s extent along ``cat_dim`` is ``cat_sizes[self.rank]``; the block received from rank ``s`` has
        ``split_sizes[self.rank]`` entries along ``split_dim`` and ``cat_sizes[s]`` along ``cat_dim``.  Used to
        hand class-sharded logits of a row-blocked batch to the rows' owners (rows out, class slices back) and,
        with the roles swapped, for the gradient.  Blocks are padded to the largest so one
        ``all_to_all_single`` does the exchange.
        """
        if self.k == 1:
            return x
        ms, mc = max(split_sizes), max(cat_sizes)
        blocks = torch.split(x, list(split_sizes), split_dim)
        send = torch.stack([pad_dim(pad_dim(b, split_dim, ms), cat_dim, mc) for b in blocks], 0).contiguous()
        recv = torch.empty_like(send)
        self.counter.add("all_to_all", (self.k - 1) * send[0].numel() * send.element_size())
        dist.all_to_all_single(recv, send, group=self.group)
        mine = split_sizes[self.rank]
        parts = [recv[s].narrow(split_dim, 0, mine).narrow(cat_dim, 0, cat_sizes[s]) for s in range(self.k)]
        return torch.cat(parts, cat_dim)

    # -- rooted collectives (scheme b) ----------------------------------------------------------------------
    def broadcast(self, x: torch.Tensor, src: int, async_op: bool = False) -> Any:
        """Broadcast ``x`` (filled on group rank ``src``, an equally shaped buffer elsewhere)."""
        if self.k == 1:
            return _Pending(None, lambda: x) if async_op else x
        x = x.contiguous()
        if self.rank != src:
            self.counter.add("broadcast", x.numel() * x.element_size())
        work = dist.broadcast(x, src=self.global_rank(src), group=self.group, async_op=True)
        pending = _Pending(work, lambda: x)
        return pending if async_op else pending.wait()

    def reduce(self, x: torch.Tensor, dst: int, async_op: bool = False) -> Any:
        """Sum ``x`` over ranks onto group rank ``dst`` (other ranks' result is meaningless)."""
        if self.k == 1:
            return _Pending(None, lambda: x) if async_op else x
        x = x.contiguous().clone()
        if self.rank != dst:
            self.counter.add("reduce", x.numel() * x.element_size())
        work = dist.reduce(x, dst=self.global_rank(dst), group=self.group, async_op=True)
        pending = _Pending(work, lambda: x)
        return pending if async_op else pending.wait()

    def gather(self, x: torch.Tensor, sizes: Sequence[int], dim: int, dst: int) -> torch.Tensor | None:
        """Concatenate every rank's block (``sizes[r]`` entries along ``dim``) on group rank ``dst``; other ranks
        get ``None``.  ``dst`` holds K padded blocks plus the result while it assembles (about twice the full
        tensor); every other rank only its padded block."""
        if self.k == 1:
            return x
        m = max(sizes)
        xm = pad_dim(x, dim, m).contiguous()
        if self.rank != dst:
            self.counter.add("gather", xm.numel() * xm.element_size())
            dist.gather(xm, None, dst=self.global_rank(dst), group=self.group)
            return None
        bufs = [torch.empty_like(xm) for _ in range(self.k)]
        dist.gather(xm, bufs, dst=self.global_rank(dst), group=self.group)
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes)], dim)

    def gather_columns(self, x: torch.Tensor, sizes: Sequence[int], dst: int) -> torch.Tensor:
        """Concatenate every rank's column block (``sizes[r]`` columns) on ``dst``; other ranks get ``(0, C)``."""
        out = self.gather(x, sizes, 1, dst)
        return x.new_empty((0, sum(sizes))) if out is None else out

    def scatter_columns(
        self, x: torch.Tensor | None, sizes: Sequence[int], rows: int, src: int, like: torch.Tensor
    ) -> torch.Tensor:
        """Inverse of :meth:`gather_columns`: ``src`` splits its ``(rows, C)`` tensor into column blocks and rank
        ``r`` receives block ``r`` (``like`` gives dtype and device)."""
        if self.k == 1:
            assert x is not None
            return x
        m = max(sizes)
        out = like.new_empty((rows, m))
        if self.rank == src:
            assert x is not None
            blocks = [pad_dim(b, 1, m).contiguous() for b in torch.split(x, list(sizes), 1)]
            dist.scatter(out, blocks, src=self.global_rank(src), group=self.group)
        else:
            self.counter.add("scatter", out.numel() * out.element_size())
            dist.scatter(out, None, src=self.global_rank(src), group=self.group)
        return out[:, : sizes[self.rank]]

"""How the last convolutional activations reach the model-parallel head: schemes a, b and c of section 4.

Each rank holds the trunk output ``x`` of its own ``b`` examples (``b x d``).  The head is model-parallel, so every
rank needs every example of a sub-batch; a scheme decides how the K x b examples are cut into sub-batches and
how each is assembled, and the reverse path returns every example's activation gradient to its owner.

``a``  one sub-batch of K x b rows, all-gathered (rows of rank r are block r); the gradient is reduce-scattered.
``b``  K sub-batches; sub-batch j is rank j's b examples, broadcast by rank j; gradients are reduced onto j.
``c``  K sub-batches; sub-batch j holds slice j (b/K rows, uneven allowed) of every rank's batch, all-gathered
       (the "all-to-all" of section 4(c): each rank sends each of its K slices to every rank, one slice per
       sub-batch, so every rank sends about as much per sub-batch and no single sender is the bottleneck);
       gradients are reduce-scattered back to the slices' owners.

Overlap (section 4(b): "the next broadcast overlaps the current head computation").  An exchange uses two
process groups: ``xcomm`` for the activations in (and their gradients back), ``comm`` (the head's group) for the
head's own between-layer collectives and the delivery of logits to the owners.  All forward exchanges of a step
are started asynchronously on ``xcomm`` up front (:meth:`Exchange.start`); the head then works on sub-batch j
while sub-batch j+1 is still in flight.  The separate group matters: collectives of one group run in issue order
(one NCCL stream, one gloo queue), so if the head's all-gather between its layers were issued on the group that
still carries the pending broadcasts of sub-batches j+1..K-1, it would wait for all of them and nothing would
overlap.  In the backward pass the reverse exchange of sub-batch j is launched asynchronously as soon as its
gradient exists (:func:`exchange_in` / :class:`_ExchangeStart`) and overlaps the backward computation of sub-batch
j-1; all of them are collected once, where the gradient re-enters the trunk.  ``overlap=False`` (for measuring
what the overlap buys) issues each exchange only when its sub-batch is needed and waits for it at once, forward
and backward, on the head's own group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from lightning_hpc.hybrid_fc.collectives import HeadComm, _Pending
from lightning_hpc.hybrid_fc.functions import (
    rows_to_owners_from_col,
    rows_to_owners_from_row,
    to_root_from_col,
    to_root_from_row,
)

__all__ = ["SCHEMES", "Exchange", "make_exchange", "exchange_in", "exchange_start"]

SCHEMES = ("a", "b", "c")


def _even_blocks(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous blocks of ``n`` rows, the first ``n % parts`` one larger.

    Same rule as :func:`lightning_hpc.distributed.partition.block_bounds`, whose non-empty check is enforced by
    the caller with a message naming the batch size."""
    from lightning_hpc.distributed.partition import block_bounds

    return block_bounds(n, parts)


class Exchange:
    """Base class: sub-batch geometry, asynchronous forward exchange, reverse exchange and delivery to owners."""

    scheme = "?"

    def __init__(self, comm: HeadComm, xcomm: HeadComm | None = None, overlap: bool = True) -> None:
        self.comm = comm  # head group: delivery of logits to owners (in the compute sequence)
        self.overlap = overlap
        # exchange group: activations in, gradients back
        self.xcomm = xcomm if xcomm is not None and overlap else comm
        self.k = comm.k
        self._pending: list[Any] = []
        self._x: torch.Tensor | None = None
        self._reverse: list[tuple[int, Any]] = []
        self.b = 0

    # geometry ---------------------------------------------------------------------------------------------
    def num_subbatches(self) -> int:
        raise NotImplementedError

    def owned_rows(self, j: int) -> tuple[int, int]:
        """[start, stop) of this rank's local examples that sit in sub-batch j."""
        raise NotImplementedError

    def subbatch_size(self, j: int) -> int:
        """Number of examples (over all ranks) in sub-batch j."""
        raise NotImplementedError

    # exchange ---------------------------------------------------------------------------------------------
    def start(self, x: torch.Tensor) -> None:
        """Launch every forward exchange of the step asynchronously (``x`` is detached); without overlap, only
        remember ``x``."""
        self.b = x.shape[0]
        self._check_batch()
        self._x = x
        n = self.num_subbatches()
        self._pending = [self._issue(j, x) for j in range(n)] if self.overlap else [None] * n

    def _check_batch(self) -> None:
        pass

    def _issue(self, j: int, x: torch.Tensor) -> Any:
        """Start the forward exchange of sub-batch j (asynchronous; returns a pending result)."""
        raise NotImplementedError

    def wait(self, j: int) -> torch.Tensor:
        if self._pending[j] is None:
            assert self._x is not None
            self._pending[j] = self._issue(j, self._x)
        return self._pending[j].wait()

    def launch_reverse(self, j: int, grad: torch.Tensor) -> None:
        """Start sub-batch j's reverse exchange asynchronously (collected by :meth:`collect_reverse`); without
        overlap it completes here."""
        pending = self.reverse(j, grad, async_op=True)
        if not self.overlap:
            pending.wait()
        self._reverse.append((j, pending))

    def collect_reverse(self, like: torch.Tensor) -> torch.Tensor:
        """Wait for every launched reverse exchange; this rank's activation gradient, shaped like ``like``."""
        gx = torch.zeros_like(like)
        for j, pending in self._reverse:
            part = pending.wait()
            a, b = self.owned_rows(j)
            if b > a:
                gx[a:b] += part
        self._reverse = []
        return gx

    def reverse(self, j: int, grad: torch.Tensor, async_op: bool = False) -> Any:
        """Send sub-batch j's (partial) activation gradient back; result: this rank's rows' gradient."""
        raise NotImplementedError

    def deliver(self, j: int, out: torch.Tensor, final_layout: str, class_sizes: list[int]) -> torch.Tensor:
        """Autograd: head output of sub-batch j (``S`` if the last layer is col, ``P`` if row) -> this rank's
        rows of sub-batch j with all classes."""
        raise NotImplementedError


class _RowBlocked(Exchange):
    """Sub-batches made of one row block per rank (schemes a and c): all-gather / reduce-scatter by rows."""

    def row_sizes(self, j: int) -> list[int]:
        raise NotImplementedError

    def local_slice(self, j: int) -> tuple[int, int]:
        raise NotImplementedError

    def owned_rows(self, j: int) -> tuple[int, int]:
        return self.local_slice(j)

    def subbatch_size(self, j: int) -> int:
        return sum(self.row_sizes(j))

    def _issue(self, j: int, x: torch.Tensor) -> Any:
        a, b = self.local_slice(j)
        return self.xcomm.all_gather(x[a:b].contiguous(), self.row_sizes(j), dim=0, async_op=True)

    def reverse(self, j: int, grad: torch.Tensor, async_op: bool = False) -> Any:
        pending = self.xcomm.reduce_scatter(grad.contiguous(), self.row_sizes(j), dim=0, async_op=True)
        return pending if async_op else pending.wait()

    def deliver(self, j: int, out: torch.Tensor, final_layout: str, class_sizes: list[int]) -> torch.Tensor:
        if final_layout == "col":
            return rows_to_owners_from_col(out, self.comm, self.row_sizes(j), class_sizes)
        return rows_to_owners_from_row(out, self.comm, self.row_sizes(j))


class SchemeA(_RowBlocked):
    """Scheme a: the head runs once on all K x b examples."""

    scheme = "a"

    def num_subbatches(self) -> int:
        return 1

    def row_sizes(self, j: int) -> list[int]:
        return [self.b] * self.k

    def local_slice(self, j: int) -> tuple[int, int]:
        return 0, self.b


class SchemeC(_RowBlocked):
    """Scheme c: sub-batch j = slice j of every rank's batch."""

    scheme = "c"

    def num_subbatches(self) -> int:
        return self.k

    def _check_batch(self) -> None:
        if self.b < self.k:
            raise ValueError(
                f"scheme='c' splits each rank's batch into K={self.k} slices, but the per-rank batch has only "
                f"{self.b} examples; use a batch size >= {self.k} per rank or scheme='a'/'b'"
            )

    def row_sizes(self, j: int) -> list[int]:
        a, b = _even_blocks(self.b, self.k)[j]
        return [b - a] * self.k

    def local_slice(self, j: int) -> tuple[int, int]:
        return _even_blocks(self.b, self.k)[j]


class SchemeB(Exchange):
    """Scheme b: ranks take turns broadcasting their whole batch; sub-batch j belongs to rank j."""

    scheme = "b"

    def num_subbatches(self) -> int:
        return self.k

    def owned_rows(self, j: int) -> tuple[int, int]:
        return (0, self.b) if j == self.comm.rank else (0, 0)

    def subbatch_size(self, j: int) -> int:
        return self.b

    def _issue(self, j: int, x: torch.Tensor) -> Any:
        buf = x.contiguous().clone() if j == self.comm.rank else x.new_empty(x.shape)
        return self.xcomm.broadcast(buf, j, async_op=True)

    def reverse(self, j: int, grad: torch.Tensor, async_op: bool = False) -> Any:
        pending = self.xcomm.reduce(grad.contiguous(), j, async_op=True)
        mine = j == self.comm.rank
        wrapped = _Pending(pending, lambda: pending.wait() if mine else grad.new_zeros((0, *grad.shape[1:])))
        return wrapped if async_op else wrapped.wait()

    def deliver(self, j: int, out: torch.Tensor, final_layout: str, class_sizes: list[int]) -> torch.Tensor:
        if final_layout == "col":
            return to_root_from_col(out, self.comm, class_sizes, j)
        return to_root_from_row(out, self.comm, j)


def make_exchange(scheme: str, comm: HeadComm, xcomm: HeadComm | None = None, overlap: bool = True) -> Exchange:
    """Exchange of ``scheme``; ``xcomm`` (a second group over the same ranks) carries the activations (see the
    module docstring for why it must differ from ``comm`` for the overlap)."""
    classes = {"a": SchemeA, "b": SchemeB, "c": SchemeC}
    if scheme in classes:
        return classes[scheme](comm, xcomm, overlap)
    raise ValueError(f"scheme must be one of {SCHEMES} (section 4 of the paper), got {scheme!r}")


class _ExchangeStart(Function):
    """Identity on this rank's activations; its backward runs after every sub-batch's backward and collects the
    asynchronously launched reverse exchanges into the trunk's activation gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: Exchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.collect_reverse(g), None


class _ExchangeIn(Function):
    """Autograd view of sub-batch j: forward waits for the prefetched exchange; backward launches the reverse
    exchange asynchronously (its result is added in :class:`_ExchangeStart`), so it overlaps the backward
    computation of the sub-batches processed before j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: Exchange, j: int) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange, ctx.j = exchange, j
        out = exchange.wait(j)
        return out.clone() if out is x else out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        ctx.exchange.launch_reverse(ctx.j, g)
        return None, None, None


def exchange_start(x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Wrap this rank's activations once per step before the sub-batches are taken with :func:`exchange_in`."""
    return _ExchangeStart.apply(x, exchange)


def exchange_in(x: torch.Tensor, exchange: Exchange, j: int) -> torch.Tensor:
    return _ExchangeIn.apply(x, exchange, j)

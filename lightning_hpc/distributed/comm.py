"""The communication interface every technique talks to.

K-FAC (factor allreduce, decomposition sharing) and layered SGD (intra-group reduce/broadcast, inter-group
allreduce) only use this interface, so the same algorithm runs on torch.distributed or on Horovod (the Horovod
implementation lives in ``lightning_hpc.horovod.communicator``).  Groups are opaque handles created by
:meth:`Communicator.new_group`; ``None`` means the whole world.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.registry import load

__all__ = ["Handle", "Communicator", "TorchDistributedCommunicator", "CompletedHandle", "get_communicator"]

ReduceOp = Literal["sum", "mean"]


class Handle(Protocol):
    """An in-flight collective; ``wait()`` blocks until its output tensor is valid."""

    def wait(self) -> Any: ...


class CompletedHandle:
    """Handle of an operation that already finished (synchronous fallbacks, no-ops on one rank)."""

    def wait(self) -> None:
        return None


class Communicator(ABC):
    """Collectives over tensors, in place, optionally asynchronous."""

    #: ``async_op=True`` returns while the collective is still running (False: a backend that completes it before
    #: returning; K-FAC then does not try to overlap its factor all-reduce with the backward pass)
    async_collectives: bool = True

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Any:
        """Create a group; must be called by every rank with the same ``ranks``."""

    @abstractmethod
    def group_size(self, group: Any = None) -> int: ...

    @abstractmethod
    def allreduce(
        self, tensor: torch.Tensor, op: ReduceOp = "mean", group: Any = None, async_op: bool = False
    ) -> Handle: ...

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Handle:
        """Broadcast from global rank ``src``."""

    @abstractmethod
    def allgather(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """Gather equally shaped tensors from every rank of the group, ordered by group rank."""

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp = "sum", group: Any = None, async_op: bool = False
    ) -> Handle:
        """Reduce onto global rank ``dst``; only ``dst``'s tensor is guaranteed to hold the result.

        The default is an allreduce (correct on every rank, more traffic); backends with a real reduce override it.
        """
        return self.allreduce(tensor, op=op, group=group, async_op=async_op)

    def barrier(self, group: Any = None) -> None:
        self.allreduce(torch.zeros(1), op="sum", group=group).wait()


class _MeanAfterWait:
    """Gloo has no AVG reduction: sum asynchronously, divide when the caller waits."""

    def __init__(self, work: Any, tensor: torch.Tensor, n: int) -> None:
        self._work, self._tensor, self._n, self._done = work, tensor, n, False

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            self._tensor.div_(self._n)
            self._done = True


class TorchDistributedCommunicator(Communicator):
    """:class:`Communicator` over torch.distributed (gloo on CPU, NCCL on GPU)."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def new_group(self, ranks: Sequence[int]) -> Any:
        from lightning_hpc.distributed.groups import new_group

        return new_group(list(ranks))  # with the world's timeout (torch would give it 30 minutes)

    def group_size(self, group: Any = None) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def allreduce(
        self, tensor: torch.Tensor, op: ReduceOp = "mean", group: Any = None, async_op: bool = False
    ) -> Handle:
        n = self.group_size(group)
        if n == 1:
            return CompletedHandle()
        if op not in ("sum", "mean"):
            raise ValueError(f"allreduce op must be 'sum' or 'mean', got {op!r}")
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        handle: Handle = _MeanAfterWait(work, tensor, n) if op == "mean" else work
        if not async_op:
            handle.wait()
        return handle

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp = "sum", group: Any = None, async_op: bool = False
    ) -> Handle:
        n = self.group_size(group)
        if n == 1:
            return CompletedHandle()
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op must be 'sum' or 'mean', got {op!r}")
        work = dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
        handle: Handle = _MeanAfterWait(work, tensor, n) if op == "mean" else work
        if not async_op:
            handle.wait()
        return handle

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Handle:
        if self.group_size(group) == 1:
            return CompletedHandle()
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        if not async_op:
            work.wait()
        return work

    def allgather(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        n = self.group_size(group)
        if n == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return out

    def barrier(self, group: Any = None) -> None:
        # torch's own barrier: the base class's all-reduce of a CPU tensor has no backend on an NCCL-only group
        if self.group_size(group) > 1:
            dist.barrier(group=group)


#: communicators of other folders by name, as "module:Class" imported on first use: the shared layer names them
#: without importing them (Horovod's implements this interface, so its module imports this one)
COMMUNICATORS: dict[str, str] = {"horovod": "lightning_hpc.horovod.communicator:HorovodCommunicator"}


def get_communicator(backend: str = "torch") -> Communicator:
    """Communicator by name: ``"torch"`` (torch.distributed) or ``"horovod"``."""
    if backend == "torch":
        # its collectives are asynchronous: gloo's pending work must not outlive the interpreter
        destroy_process_group_at_exit()
        return TorchDistributedCommunicator()
    if backend in COMMUNICATORS:
        return load(COMMUNICATORS[backend])()  # type: ignore[no-any-return]
    raise ValueError(f"unknown communication backend {backend!r}; use 'torch' or 'horovod'")

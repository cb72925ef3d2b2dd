"""Hierarchical (two-layer) allreduce of layered SGD, split into a start and a finish.

Yu et al., "Layered SGD", Sec. 4.1 (communication flow) and Algorithm 3 lines 6, 8 and 9:

1. ``start``: every rank reduces its buffer to its group's leader (the paper's *communicator*) inside the
   group -- cheap, intra-node (NCCL on GPUs);
2. the leaders allreduce among themselves and divide by the world size.  This step runs on a CPU process
   group (gloo) driven by a communicator *thread* on the leader, so the main thread (and the accelerator) is
   free to load the next batch meanwhile -- the overlap that hides the slow inter-node link;
3. ``finish``: the leader broadcasts the global mean back to the workers of its group.

Plain torch.distributed; every collective goes through :class:`~lightning_hpc.distributed.comm.Communicator`
so another backend (Horovod) can be plugged in.  A collective that does not complete within ``timeout_s``
raises :class:`LayeredCommTimeout` naming the group and rank instead of hanging.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator, get_communicator
from lightning_hpc.distributed.groups import check_divisible, default_timeout, node_groups

__all__ = ["LayeredCommTimeout", "LayeredGroups", "build_layered_groups", "HierarchicalAllreduce"]


class LayeredCommTimeout(RuntimeError):
    """A layered-SGD collective failed or did not complete in time; the message names group and rank."""


@dataclass
class LayeredGroups:
    """The two communication layers: this rank's node group and (on leaders) the group of leaders."""

    rank: int
    world_size: int
    group_size: int
    group_index: int
    leader_rank: int
    intra: Any
    leaders: Any | None

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader_rank

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size}, node group {self.group_index} of {self.num_groups} "
            f"(ranks {self.leader_rank}..{self.leader_rank + self.group_size - 1}, leader {self.leader_rank})"
        )


def build_layered_groups(
    procs_per_node: int,
    communicator: Communicator | None = None,
    *,
    intra_backend: str | None = None,
    timeout_s: float | None = None,
) -> LayeredGroups:
    """Create the node groups (all ranks must call this together).

    With torch.distributed the groups come from :func:`lightning_hpc.distributed.groups.node_groups` (the leader
    group on gloo so a CPU thread can drive it); another communicator creates them with its own ``new_group``.
    Raises ``ValueError`` naming ``procs_per_node`` when it does not divide the world size.
    """
    comm = communicator or get_communicator("torch")
    world, rank = comm.world_size, comm.rank
    check_divisible(world, procs_per_node, what="ranks per node group", setting="procs_per_node")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else default_timeout()
    if isinstance(comm, TorchDistributedCommunicator):
        ng = node_groups(procs_per_node, intra_backend=intra_backend, leader_backend="gloo", timeout=timeout)
        return LayeredGroups(rank, world, procs_per_node, ng.group_index, ng.leader_rank, ng.intra, ng.leaders)
    # Same contiguous layout as node_groups, through the communicator's own group creation.
    intra = None
    for g in range(world // procs_per_node):
        ranks = list(range(g * procs_per_node, (g + 1) * procs_per_node))
        handle = comm.new_group(ranks)
        if rank in ranks:
            intra = handle
    leader_ranks = list(range(0, world, procs_per_node))
    leaders = comm.new_group(leader_ranks)
    leader = (rank // procs_per_node) * procs_per_node
    return LayeredGroups(
        rank, world, procs_per_node, rank // procs_per_node, leader, intra, leaders if rank == leader else None
    )


class _Job:
    """One inter-group allreduce handed to the communicator thread."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class HierarchicalAllreduce:
    """Global mean of a flat buffer in three steps, the slow middle one off the main thread.

    ``start(buf)`` performs step 1 and hands step 2 to the communicator thread; ``finish()`` waits for it and
    performs step 3, after which ``buf`` holds the mean over all ranks on every rank.  Between the two the
    caller must not touch ``buf`` (the paper's workers load the next mini-batch meanwhile).
    """

    def __init__(
        self,
        groups: LayeredGroups,
        communicator: Communicator | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.groups = groups
        self.comm = communicator or get_communicator("torch")
        self.timeout_s = float(timeout_s) if timeout_s else default_timeout().total_seconds()
        self._buffer: torch.Tensor | None = None
        self._job: _Job | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        #: seconds of the last inter-group allreduce as the communicator thread measured it (leaders only)
        self.last_inter_seconds: float = 0.0

    @property
    def pending(self) -> bool:
        return self._buffer is not None

    # ------------------------------------------------------------------ steps
    def start(self, buffer: torch.Tensor) -> None:
        """Step 1 (reduce to the leader) and launch of step 2 (leaders' allreduce, on the thread)."""
        if self._buffer is not None:
            raise RuntimeError("HierarchicalAllreduce.start called twice without finish()")
        g = self.groups
        self._buffer = buffer
        if g.num_groups == 1:
            # One group: there is no step 2, so steps 1 and 3 fuse into one intra-group allreduce.
            self._wait(self.comm.allreduce(buffer, op="sum", group=g.intra, async_op=True), "intra-group allreduce")
            buffer.div_(g.world_size)
            return
        self._wait(
            self.comm.reduce(buffer, dst=g.leader_rank, op="sum", group=g.intra, async_op=True),
            "reduce to the group leader (step 1)",
        )
        if g.is_leader:
            self._ensure_thread()
            self._job = _Job(buffer)
            self._queue.put(self._job)

    def finish(self) -> torch.Tensor:
        """Wait for step 2, then step 3 (broadcast from the leader inside the group); returns the buffer."""
        if self._buffer is None:
            raise RuntimeError("HierarchicalAllreduce.finish called without start()")
        buffer, job, g = self._buffer, self._job, self.groups
        self._buffer, self._job = None, None
        if g.num_groups == 1:
            return buffer
        if job is not None:
            if not job.done.wait(self.timeout_s):
                raise LayeredCommTimeout(
                    f"layered SGD: the inter-group allreduce among group leaders (step 2) did not complete within "
                    f"{self.timeout_s:.0f}s on {g.describe()}; another node is probably not reaching this step"
                )
            if job.error is not None:
                raise LayeredCommTimeout(
                    f"layered SGD: the inter-group allreduce (step 2) failed on {g.describe()}: {job.error}"
                ) from job.error
            assert job.result is not None
            if job.result is not buffer:
                buffer.copy_(job.result, non_blocking=False)
        self._wait(
            self.comm.broadcast(buffer, src=g.leader_rank, group=g.intra, async_op=True),
            "broadcast from the group leader (step 3)",
        )
        return buffer

    def allreduce_mean(self, buffer: torch.Tensor) -> torch.Tensor:
        """Blocking form: ``start`` then ``finish``."""
        self.start(buffer)
        return self.finish()

    # ------------------------------------------------------------------ thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="layered-sgd-communicator", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                t0 = time.perf_counter()
                # The leader group is gloo: stage through host memory (a no-op for CPU tensors).
                host = job.buffer.to("cpu") if job.buffer.device.type != "cpu" else job.buffer
                self.comm.allreduce(host, op="sum", group=self.groups.leaders, async_op=True).wait()
                host.div_(self.groups.world_size)
                job.result = host
                self.last_inter_seconds = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by finish()
                job.error = e
            finally:
                job.done.set()

    def close(self) -> None:
        """Stop the communicator thread (pending work is abandoned)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5.0)
        self._thread = None
        self._buffer, self._job = None, None

    def _wait(self, handle: Any, what: str) -> None:
        try:
            handle.wait()
        except Exception as e:  # gloo raises on its process-group timeout; NCCL's watchdog aborts
            raise LayeredCommTimeout(
                f"layered SGD: {what} failed or timed out (timeout {self.timeout_s:.0f}s) on "
                f"{self.groups.describe()}: {e}"
            ) from e


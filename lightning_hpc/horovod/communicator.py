"""Horovod behind the :class:`~lightning_hpc.distributed.comm.Communicator` interface.

K-FAC (factor allreduce, decomposition sharing; Pauloski et al., "Convolutional Neural Network Training with
Distributed K-FAC", SC'20, whose reference implementation ran on Horovod) and layered SGD (intra-group and
inter-group steps) only talk to :class:`Communicator`, so this class is all it takes to run them on Horovod.

Mapping (Horovod 0.28):

* groups are Horovod *process sets* (``hvd.add_process_set``), which need Horovod initialised with dynamic
  process sets; :func:`init_horovod` does that.  Process sets are collective to create and cannot be
  duplicated, so they are cached by their (sorted) ranks and the whole world maps to ``global_process_set``;
* ``allreduce`` is ``hvd.allreduce_async_`` (in place, ``hvd.Average``/``hvd.Sum``), ``Handle.wait`` is
  ``hvd.synchronize``; Horovod's background thread fuses concurrent small allreduces (tensor fusion);
* ``broadcast`` takes a *global* source rank, in torch.distributed and in Horovod alike (Horovod translates it
  to the rank inside the process set and rejects a source outside the set);
* ``allgather`` stacks a leading dimension and splits it again, ordered by rank within the set (which is the
  sorted order of its global ranks, as for ``torch.distributed.new_group``).

Horovod is optional: nothing here imports it at module import time; :func:`import_horovod` raises
:class:`HorovodUnavailableError` saying how to install it (``scripts/install-horovod.sh``).

Stalls: Horovod has no per-collective timeout; it warns after ``HOROVOD_STALL_CHECK_TIME_SECONDS`` and shuts
down after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (we default the latter to 300 s when unset, so a missing rank
fails the job instead of hanging it).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from lightning_hpc.distributed.comm import (
    Communicator,
    CompletedHandle,
    Handle,
    ReduceOp,
)

__all__ = [
    "HorovodUnavailableError",
    "INSTALL_HINT",
    "import_horovod",
    "horovod_available",
    "init_horovod",
    "collective_name",
    "HorovodHandle",
    "HorovodCommunicator",
]

INSTALL_HINT = (
    "Horovod is an optional dependency of lightning_hpc and is not importable here. Build and install it "
    "against your torch with `scripts/install-horovod.sh [PYTHON]` from the lightning_hpc repository "
    "(Horovod 0.28.1 needs a C++17 build for torch >= 2.1; the script does that, with Gloo, plus NCCL when "
    "CUDA is present). See docs/horovod.md."
)

#: default for HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: a rank that never joins a collective ends the job
DEFAULT_STALL_SHUTDOWN_S = 300


class HorovodUnavailableError(ImportError):
    """Horovod (``horovod.torch``) cannot be imported; the message says how to install it."""


def import_horovod() -> ModuleType:
    """``horovod.torch``, or :class:`HorovodUnavailableError` with install instructions."""
    try:
        import horovod.torch as hvd
    except ImportError as err:  # includes a broken build (undefined symbols against another torch)
        raise HorovodUnavailableError(f"{INSTALL_HINT} (import error: {err})") from err
    return hvd


def horovod_available() -> bool:
    """Whether ``horovod.torch`` imports (used to skip tests and to pick defaults)."""
    try:
        import_horovod()
    except HorovodUnavailableError:
        return False
    return True


def init_horovod() -> ModuleType:
    """Initialise Horovod once (dynamic process sets enabled, so groups can be created later)."""
    hvd = import_horovod()
    if not hvd.is_initialized():
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(DEFAULT_STALL_SHUTDOWN_S))
        hvd.init(process_sets="dynamic")
    return hvd


_NAME_COUNTERS: dict[tuple[str, int], itertools.count] = {}
_NAME_LOCK = threading.Lock()


def collective_name(kind: str, process_set: Any = None) -> str:
    """A name for the next ``kind`` collective on ``process_set``, the same on every member rank.

    Horovod matches a collective across ranks by its name.  Unnamed ones are called ``<op>.noname.<handle>``
    with a per-process handle counter, which differs between ranks as soon as another thread (layered SGD's
    communicator thread, say) issues collectives in a different interleaving.  Counting per (kind, process
    set) instead only needs every member to issue that set's collectives in the same order, which any
    correct program does anyway.
    """
    set_id = int(getattr(process_set, "process_set_id", 0) or 0)
    with _NAME_LOCK:
        counter = _NAME_COUNTERS.setdefault((kind, set_id), itertools.count())
        return f"lightning_hpc.{kind}.ps{set_id}.{next(counter)}"


class HorovodHandle:
    """An in-flight Horovod collective: ``wait()`` is ``hvd.synchronize`` (idempotent)."""

    def __init__(self, hvd: ModuleType, handle: int) -> None:
        self._hvd, self._handle, self._done = hvd, handle, False

    def wait(self) -> None:
        if not self._done:
            self._hvd.synchronize(self._handle)
            self._done = True


class HorovodCommunicator(Communicator):
    """:class:`Communicator` over Horovod (Gloo, MPI or NCCL, whatever Horovod was built and launched with).

    Groups are Horovod process sets; :meth:`new_group` is collective (every rank, same ranks), like
    ``torch.distributed.new_group``.  On ranks outside a group, operations on that group must not be called
    (same contract as torch.distributed).
    """

    #: process sets already created, by sorted ranks (Horovod refuses duplicates); shared by all instances
    _process_sets: dict[tuple[int, ...], Any] = {}

    def __init__(self) -> None:
        self._hvd = init_horovod()

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def world_size(self) -> int:
        return self._hvd.size()

    def _process_set(self, group: Any) -> Any:
        return self._hvd.global_process_set if group is None else group

    def new_group(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(int(r) for r in ranks))
        if len(set(key)) != len(key) or not key or key[0] < 0 or key[-1] >= self.world_size:
            raise ValueError(f"new_group: ranks must be distinct and in [0, {self.world_size}), got {list(ranks)}")
        if key == tuple(range(self.world_size)):
            return self._hvd.global_process_set
        cached = self._process_sets.get(key)
        if cached is not None:
            return cached
        if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
            raise RuntimeError(
                "HorovodCommunicator.new_group needs Horovod initialised with dynamic process sets: let "
                "lightning_hpc initialise Horovod (init_horovod()), or call hvd.init(process_sets='dynamic') "
                "yourself, or set HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init()."
            )
        process_set = self._hvd.add_process_set(list(key))
        self._process_sets[key] = process_set
        return process_set

    def group_size(self, group: Any = None) -> int:
        return self._process_set(group).size()

    def allreduce(
        self, tensor: torch.Tensor, op: ReduceOp = "mean", group: Any = None, async_op: bool = False
    ) -> Handle:
        if op not in ("sum", "mean"):
            raise ValueError(f"allreduce op must be 'sum' or 'mean', got {op!r}")
        process_set = self._process_set(group)
        if process_set.size() == 1:
            return CompletedHandle()
        hvd_op = self._hvd.Average if op == "mean" else self._hvd.Sum
        name = collective_name("allreduce", process_set)
        handle = HorovodHandle(
            self._hvd, self._hvd.allreduce_async_(tensor, op=hvd_op, name=name, process_set=process_set)
        )
        if not async_op:
            handle.wait()
        return handle

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Handle:
        process_set = self._process_set(group)
        if process_set.size() == 1:
            return CompletedHandle()
        ranks = process_set.ranks if process_set.ranks is not None else list(range(self.world_size))
        if src not in ranks:
            raise ValueError(f"broadcast: source rank {src} is not in the group {sorted(ranks)}")
        # Horovod's root_rank is a global rank (translated to the set's rank in C++, operations.cc)
        name = collective_name("broadcast", process_set)
        handle = HorovodHandle(
            self._hvd, self._hvd.broadcast_async_(tensor, root_rank=src, name=name, process_set=process_set)
        )
        if not async_op:
            handle.wait()
        return handle

    def allgather(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        process_set = self._process_set(group)
        if process_set.size() == 1:
            return [tensor.clone()]
        name = collective_name("allgather", process_set)
        stacked = self._hvd.allgather(tensor.contiguous().unsqueeze(0), name=name, process_set=process_set)
        return list(stacked.unbind(0))

    def barrier(self, group: Any = None) -> None:
        process_set = self._process_set(group)
        if process_set.size() > 1:
            self._hvd.barrier(process_set=process_set)

"""Which communication backend a technique should use: the one its Lightning strategy communicates with.

K-FAC and layered SGD talk to a :class:`~lightning_hpc.distributed.comm.Communicator`; with
``communicator="auto"`` they ask :func:`communicator_for` here, so under ``Trainer(strategy="horovod")`` their
collectives run on Horovod and under DDP-style strategies on torch.distributed.  A strategy declares its
backend with a ``communication_backend`` attribute (``"horovod"`` on
:class:`~lightning_hpc.horovod.strategy.HorovodStrategy`), or through its cluster environment
(:class:`~lightning_hpc.horovod.environment.HorovodEnvironment`: a DDP-derived strategy launched by
``horovodrun``); neither means torch.distributed.  Duck typing keeps ``distributed/`` free of strategy imports.
"""

from __future__ import annotations

from typing import Any

from lightning_hpc.distributed.comm import Communicator, get_communicator

__all__ = ["BACKENDS", "backend_for", "communicator_for"]

BACKENDS = ("auto", "torch", "horovod")


def backend_for(strategy: Any | None, requested: str = "auto") -> str:
    """``requested`` unless it is ``"auto"``; then the strategy's ``communication_backend`` (default torch)."""
    if requested not in BACKENDS:
        raise ValueError(f"communicator must be one of {BACKENDS} or a Communicator, got {requested!r}")
    if requested != "auto":
        return requested
    backend = getattr(strategy, "communication_backend", None)
    if backend is None:
        backend = getattr(getattr(strategy, "cluster_environment", None), "communication_backend", "torch")
    return backend if backend in ("torch", "horovod") else "torch"


def communicator_for(strategy: Any | None, requested: str | Communicator = "auto") -> Communicator:
    """The communicator a technique running under ``strategy`` should use (an instance passes through)."""
    if isinstance(requested, Communicator):
        return requested
    return get_communicator(backend_for(strategy, requested))

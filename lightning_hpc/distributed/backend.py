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
from lightning_hpc.protocols import CommunicationBackendAware

__all__ = ["BACKENDS", "backend_for", "communicator_for"]

BACKENDS = ("auto", "torch", "horovod")


def backend_for(strategy: Any | None, requested: str = "auto") -> str:
    """``requested`` unless it is ``"auto"``; then the strategy's ``communication_backend`` (default torch)."""
    if requested not in BACKENDS:
        raise ValueError(f"communicator must be one of {BACKENDS} or a Communicator, got {requested!r}")
    if requested != "auto":
        return requested
    for declared in (strategy, getattr(strategy, "cluster_environment", None)):
        if isinstance(declared, CommunicationBackendAware):
            if declared.communication_backend not in ("torch", "horovod"):
                raise ValueError(f"{type(declared).__name__}.communication_backend must be 'torch' or 'horovod'")
            return declared.communication_backend
    return "torch"


def communicator_for(strategy: Any | None, requested: str | Communicator = "auto") -> Communicator:
    """The communicator a technique running under ``strategy`` should use (an instance passes through)."""
    if isinstance(requested, Communicator):
        return requested
    return get_communicator(backend_for(strategy, requested))

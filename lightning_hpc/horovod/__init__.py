"""Horovod: a :class:`~lightning_hpc.distributed.comm.Communicator` over Horovod's collectives
(:mod:`communicator`, plain torch + Horovod), a Lightning cluster environment for ``horovodrun``
(:mod:`environment`) and a Lightning 2.x strategy (:mod:`strategy`).  Importing this package never imports
Horovod itself."""

from lightning_hpc.horovod.communicator import HorovodCommunicator

__all__ = ["HorovodCommunicator"]

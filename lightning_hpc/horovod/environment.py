"""Lightning ``ClusterEnvironment`` whose ranks come from Horovod (used by HorovodStrategy and, under
``horovodrun``, by DDP-derived strategies such as layered SGD).

Horovod's launchers (``horovodrun``, or ``mpirun``/``srun`` for MPI builds) start every process themselves and
Horovod knows the world after ``hvd.init()``: global rank, size, local rank and the node index (``cross_rank``).
Lightning only needs to read them, never to set them.
"""

from __future__ import annotations

import os
import socket

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from lightning_hpc.horovod.communicator import init_horovod

__all__ = ["HorovodEnvironment"]

#: variables set by horovodrun (Gloo and MPI launch) or by an MPI launcher for every process
_LAUNCH_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes read from an initialised Horovod (initialising it on first use).

    ``HorovodStrategy`` needs nothing else.  DDP-derived strategies (``DDPStrategy``, layered SGD) can also run
    under ``horovodrun`` with ``cluster_environment=HorovodEnvironment()``: they open a torch.distributed
    process group at ``main_address:main_port``, which rank 0 picks (``MASTER_ADDR``/``MASTER_PORT`` when set,
    else its host name and a free port) and Horovod broadcasts on first use; every rank reaches that point
    together, in the strategy's process-group setup.
    """

    #: techniques with ``communicator="auto"`` under a strategy using this environment talk through Horovod
    communication_backend = "horovod"

    def __init__(self) -> None:
        self._main: tuple[str, int] | None = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._rendezvous()[0]

    @property
    @override
    def main_port(self) -> int:
        return self._rendezvous()[1]

    def _rendezvous(self) -> tuple[str, int]:
        if self._main is None:
            hvd = init_horovod()
            mine = None
            if hvd.rank() == 0:
                address = os.environ.get("MASTER_ADDR") or _host_name()
                port = int(os.environ.get("MASTER_PORT", 0)) or _free_port()
                mine = (address, port)
            if hvd.size() == 1:
                self._main = mine
            else:
                self._main = hvd.broadcast_object(mine, root_rank=0, name="lightning_hpc.torch_rendezvous")
        assert self._main is not None
        return self._main

    @staticmethod
    @override
    def detect() -> bool:
        return any(name in os.environ for name in _LAUNCH_VARIABLES)

    @staticmethod
    def launched_by_horovodrun() -> bool:
        """``horovodrun`` exports HOROVOD_RANK; plain ``mpirun`` (also used without Horovod) does not."""
        return "HOROVOD_RANK" in os.environ

    @override
    def world_size(self) -> int:
        return init_horovod().size()

    @override
    def set_world_size(self, size: int) -> None:
        # the launcher fixed it; a different request is reported by HorovodStrategy's consistency check
        pass

    @override
    def global_rank(self) -> int:
        return init_horovod().rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return init_horovod().local_rank()

    @override
    def node_rank(self) -> int:
        return init_horovod().cross_rank()


def _host_name() -> str:
    # horovodrun exports the host name it reached this rank by (-H); MPI launches fall back to the FQDN
    name = os.environ.get("HOROVOD_HOSTNAME")
    if name is None:
        return socket.getfqdn()
    return "127.0.0.1" if name in ("localhost", "127.0.0.1") else name


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])

"""Lightning ``ClusterEnvironment`` whose ranks come from Horovod.

Horovod's launchers (``horovodrun``, or ``mpirun``/``srun`` for MPI builds) start every process themselves and
Horovod knows the world after ``hvd.init()``: global rank, size, local rank and the node index (``cross_rank``).
Lightning only needs to read them, never to set them.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment

from lightning_hpc.distributed.horovod_comm import init_horovod

__all__ = ["HorovodEnvironment"]

#: variables set by horovodrun (Gloo and MPI launch) or by an MPI launcher for every process
_LAUNCH_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes read from an initialised Horovod (initialising it on first use)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # Horovod does its own rendezvous; Lightning never opens a torch.distributed store for this strategy.
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return any(name in os.environ for name in _LAUNCH_VARIABLES)

    def world_size(self) -> int:
        return init_horovod().size()

    def set_world_size(self, size: int) -> None:
        # the launcher fixed it; a different request is reported by HorovodStrategy's consistency check
        pass

    def global_rank(self) -> int:
        return init_horovod().rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return init_horovod().local_rank()

    def node_rank(self) -> int:
        return init_horovod().cross_rank()

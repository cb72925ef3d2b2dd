"""Pieces shared by every technique: process groups, the communication interface, multi-process runs."""

from lightning_hpc.distributed.comm import (
    Communicator,
    TorchDistributedCommunicator,
    get_communicator,
)
from lightning_hpc.distributed.groups import (
    MeshDim,
    NodeGroups,
    build_mesh,
    check_divisible,
    default_timeout,
    mesh_2d,
    node_groups,
)
from lightning_hpc.distributed.spawn import (
    DistributedRunError,
    find_free_port,
    run_in_processes,
)

__all__ = [
    "Communicator",
    "TorchDistributedCommunicator",
    "get_communicator",
    "MeshDim",
    "NodeGroups",
    "build_mesh",
    "check_divisible",
    "default_timeout",
    "mesh_2d",
    "node_groups",
    "DistributedRunError",
    "find_free_port",
    "run_in_processes",
]

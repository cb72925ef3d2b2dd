"""Layered SGD (Yu et al.): hierarchical gradient reduction (reduce in the node, allreduce across nodes,
broadcast back) and the postponed update that overlaps it with the next step's data loading.

Plain PyTorch + torch.distributed; the Lightning adapter is :mod:`lightning_hpc.layered_sgd.strategy`.
"""

from lightning_hpc.layered_sgd.hierarchical import (
    HierarchicalAllreduce,
    LayeredGroups,
    build_layered_groups,
)
from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate

__all__ = ["HierarchicalAllreduce", "LayeredGroups", "PostponedUpdate", "build_layered_groups"]

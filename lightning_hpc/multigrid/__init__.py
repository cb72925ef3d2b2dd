"""Layer-parallel multigrid (FAS / MGRIT) for deep residual networks (Kirby et al.; Guenther et al.).

The solver is plain torch + torch.distributed (no Lightning); ``strategy.py`` is the Lightning adapter and is
not imported here.
"""

from lightning_hpc.multigrid.checkpoint import full_optimizer_state, local_optimizer_state
from lightning_hpc.multigrid.fas import fas_cycle, mgrit_solve
from lightning_hpc.multigrid.function import (
    LayerParallelSolver,
    MultigridFunction,
    MultigridODEBlock,
)
from lightning_hpc.multigrid.grad_norms import grad_norm
from lightning_hpc.multigrid.options import MultigridOptions, SolveSettings
from lightning_hpc.multigrid.partition import LayerPartition, check_layer_partition
from lightning_hpc.multigrid.pm import PartitionedODEBlock
from lightning_hpc.multigrid.sharded import LayerShardedTrunk, full_model_state_dict

__all__ = [
    "fas_cycle",
    "mgrit_solve",
    "grad_norm",
    "LayerParallelSolver",
    "MultigridFunction",
    "MultigridODEBlock",
    "MultigridOptions",
    "SolveSettings",
    "LayerPartition",
    "check_layer_partition",
    "PartitionedODEBlock",
    "LayerShardedTrunk",
    "full_model_state_dict",
    "full_optimizer_state",
    "local_optimizer_state",
]

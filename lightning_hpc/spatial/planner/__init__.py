"""Performance model and parallel-execution planner for hybrid sample x spatial parallelism.

Dryden et al., "Improving Strong-Scaling of CNN Training by Exploiting Finer-Grained Parallelism" (IPDPS 2019),
section V, one concept per module (each module's docstring gives the details):

* :mod:`.graph`: the network traced with torch.fx into layers grouped into stages (sections V-B, V-C);
* :mod:`.cost`: V-A and V-B, the cost of a stage under a distribution ``D = (n, h, w)`` and of a shuffle;
* :mod:`.search`: V-C, candidate distributions, shortest path (line networks), longest path first (branches);
* :mod:`.simulate`: V-B, the time per mini-batch of an assignment;
* :mod:`.api`: :func:`plan_for_model` and the :class:`Plan` it returns.

This package is plain torch: it never imports Lightning, and of the tile kernels only
:func:`lightning_hpc.spatial.kernels.tile_convolution_applies` (for the cost of the halo box copies).
"""

from __future__ import annotations

from lightning_hpc.spatial.planner.api import Plan, plan_for_model
from lightning_hpc.spatial.planner.cost import DDP_BUCKET_BYTES as DDP_BUCKET_BYTES
from lightning_hpc.spatial.planner.cost import DDP_FIRST_BUCKET_BYTES as DDP_FIRST_BUCKET_BYTES
from lightning_hpc.spatial.planner.cost import GRADIENT_REDUCTIONS as GRADIENT_REDUCTIONS
from lightning_hpc.spatial.planner.cost import CostModel, StageCost
from lightning_hpc.spatial.planner.graph import Distribution, LayerInfo, Stage, build_stages, trace_layers
from lightning_hpc.spatial.planner.search import brute_force_line as brute_force_line
from lightning_hpc.spatial.planner.search import candidate_distributions, shortest_line_path

__all__ = [
    "Distribution",
    "LayerInfo",
    "Stage",
    "StageCost",
    "Plan",
    "trace_layers",
    "build_stages",
    "candidate_distributions",
    "shortest_line_path",
    "plan_for_model",
    "CostModel",
]

"""Performance model and parallel-execution planner for hybrid sample x spatial parallelism.

Dryden et al., "Improving Strong-Scaling of CNN Training by Exploiting Finer-Grained Parallelism" (IPDPS 2019),
section V, one concept per module:

* :mod:`.graph`: the network as the planner sees it, traced with torch.fx into layers (every layer, not only
  convolutions, section V-B) grouped into stages: layers other than convolutions and linear layers inherit the
  distribution of their parent (section V-C), so a *stage* is a convolution or linear layer with the layers that
  follow it.
* :mod:`.cost`: V-A, per-layer cost under a distribution ``D = (n, h, w)`` (sample, height and width parts):
  measured local compute (forward + backward at the tile's shape, :class:`lightning_hpc.perfmodel.LayerTimer`),
  halo exchanges ``2 SR(O n C w) + 2 SR(O n C h) + 4 SR(O^2 n C)`` in forward and again in backward, and the
  weight-gradient allreduce ``AR(P, |w|)``, with alpha-beta costs from :mod:`lightning_hpc.perfmodel.alphabeta`;
  V-B, spatially aggregated batch norm adds two small allreduces over the spatial group, and a change of
  distribution between adjacent layers costs an all-to-all shuffle forward and backward.
* :mod:`.search`: V-C, candidate distributions per layer, then the shortest path through the candidate graph for
  line networks (:func:`shortest_line_path`), and the longest-path-first heuristic for branching networks (ResNet).
* :mod:`.simulate`: V-B, the time per mini-batch of an assignment, the gradient allreduces overlapped greedily
  with the rest of backpropagation, one allreduce at a time.
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

"""Performance model and parallel-execution planner for hybrid sample x spatial parallelism (section V of Dryden
et al., IPDPS 2019); the implementation lives in :mod:`lightning_hpc.spatial.planner.api`."""

from __future__ import annotations

from lightning_hpc.spatial.planner.api import (
    DDP_BUCKET_BYTES as DDP_BUCKET_BYTES,
)
from lightning_hpc.spatial.planner.api import (
    DDP_FIRST_BUCKET_BYTES as DDP_FIRST_BUCKET_BYTES,
)
from lightning_hpc.spatial.planner.api import (
    GRADIENT_REDUCTIONS as GRADIENT_REDUCTIONS,
)
from lightning_hpc.spatial.planner.api import (
    CostModel,
    Distribution,
    LayerInfo,
    Plan,
    Stage,
    StageCost,
    build_stages,
    candidate_distributions,
    plan_for_model,
    shortest_line_path,
    trace_layers,
)
from lightning_hpc.spatial.planner.api import (
    brute_force_line as brute_force_line,
)

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

"""K-FAC gradient preconditioning (Pauloski et al., SC20), plain torch; Lightning adapters in callback.py and
precision.py."""

from lightning_hpc.kfac.layers import (
    Conv2dHandler,
    LayerHandler,
    LinearHandler,
    TiledConv2dHandler,
    make_handler,
)
from lightning_hpc.kfac.placement import PLACEMENTS, assign_factors, placement_summary
from lightning_hpc.kfac.preconditioner import COMPUTE_METHODS, KFACPreconditioner
from lightning_hpc.kfac.schedules import KFACSchedule

__all__ = [
    "KFACPreconditioner",
    "KFACSchedule",
    "COMPUTE_METHODS",
    "PLACEMENTS",
    "assign_factors",
    "placement_summary",
    "LayerHandler",
    "LinearHandler",
    "Conv2dHandler",
    "TiledConv2dHandler",
    "make_handler",
]

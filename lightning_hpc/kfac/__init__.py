"""K-FAC gradient preconditioning (Pauloski et al., SC20), plain torch; Lightning adapters in callback.py and
precision.py."""

from lightning_hpc.kfac.layers import (
    ConvHandler,
    ConvTransposeHandler,
    GroupConvHandler,
    LayerHandler,
    LinearHandler,
    TiledConv2dHandler,
    make_handlers,
)
from lightning_hpc.kfac.methods import (
    COMPUTE_METHODS,
    ComputeMethod,
    EigenMethod,
    InverseMethod,
)
from lightning_hpc.kfac.options import KFACOptions
from lightning_hpc.kfac.placement import (
    PLACEMENTS,
    Placement,
    assign_factors,
    make_placement,
    placement_summary,
)
from lightning_hpc.kfac.preconditioner import KFACPreconditioner
from lightning_hpc.kfac.schedules import KFACSchedule

__all__ = [
    "COMPUTE_METHODS",
    "PLACEMENTS",
    "ComputeMethod",
    "ConvHandler",
    "ConvTransposeHandler",
    "GroupConvHandler",
    "EigenMethod",
    "InverseMethod",
    "KFACOptions",
    "KFACPreconditioner",
    "KFACSchedule",
    "LayerHandler",
    "LinearHandler",
    "Placement",
    "TiledConv2dHandler",
    "assign_factors",
    "make_handlers",
    "make_placement",
    "placement_summary",
]

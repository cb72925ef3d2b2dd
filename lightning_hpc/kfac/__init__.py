"""K-FAC gradient preconditioning (Pauloski et al., SC20), plain torch; Lightning adapters in callback.py and
precision.py."""

from lightning_hpc.kfac.forms import BlockDiagonalForm, DenseForm, DiagonalForm, FactorForm, LayerForms
from lightning_hpc.kfac.layers import (
    LAYER_TYPES,
    ConvHandler,
    ConvTransposeHandler,
    EmbeddingHandler,
    GroupConvHandler,
    GroupConvTransposeHandler,
    LayerHandler,
    LinearHandler,
    NormAffineHandler,
    TiledConvHandler,
    make_handler,
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
    "LAYER_TYPES",
    "PLACEMENTS",
    "BlockDiagonalForm",
    "ComputeMethod",
    "ConvHandler",
    "ConvTransposeHandler",
    "DenseForm",
    "DiagonalForm",
    "EmbeddingHandler",
    "FactorForm",
    "GroupConvHandler",
    "GroupConvTransposeHandler",
    "EigenMethod",
    "InverseMethod",
    "KFACOptions",
    "KFACPreconditioner",
    "KFACSchedule",
    "LayerForms",
    "LayerHandler",
    "LinearHandler",
    "NormAffineHandler",
    "Placement",
    "TiledConvHandler",
    "assign_factors",
    "make_handler",
    "make_placement",
    "placement_summary",
]

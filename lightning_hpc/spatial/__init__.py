"""Spatial (and hybrid sample x spatial) parallelism for CNNs (Dryden et al., "Improving Strong-Scaling of CNN
Training by Exploiting Finer-Grained Parallelism").

Plain PyTorch + torch.distributed: the tile grid (:mod:`tiling`), the halo exchange (:mod:`halo_exchange`),
distributed layers (:mod:`conv`, :mod:`pooling`, :mod:`batchnorm`, :mod:`upsample`, :mod:`heads`), the
setup-time split check (:mod:`split_check`), model conversion (:mod:`convert`) and gradient reduction
(:mod:`gradients`).  The Lightning adapter is :mod:`strategy` (imported lazily by the registry).
"""

from lightning_hpc.spatial.batchnorm import SpatialBatchNorm2d
from lightning_hpc.spatial.conv import SpatialConv2d
from lightning_hpc.spatial.halo_exchange import (
    HaloPlan,
    PartitionError,
    Window1d,
    halo_exchange,
)
from lightning_hpc.spatial.heads import SpatialGlobalAvgPool2d
from lightning_hpc.spatial.pooling import SpatialAvgPool2d, SpatialMaxPool2d
from lightning_hpc.spatial.tiling import (
    HybridLayout,
    SpatialGrid,
    create_hybrid_layout,
    tile_slices,
)
from lightning_hpc.spatial.upsample import SpatialUpsample

__all__ = [
    "HaloPlan",
    "HybridLayout",
    "PartitionError",
    "SpatialAvgPool2d",
    "SpatialBatchNorm2d",
    "SpatialConv2d",
    "SpatialGlobalAvgPool2d",
    "SpatialGrid",
    "SpatialMaxPool2d",
    "SpatialUpsample",
    "Window1d",
    "create_hybrid_layout",
    "halo_exchange",
    "tile_slices",
]

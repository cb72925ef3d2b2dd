"""Spatial (and hybrid sample x spatial) parallelism for CNNs (Dryden et al., "Improving Strong-Scaling of CNN
Training by Exploiting Finer-Grained Parallelism").

Plain PyTorch + torch.distributed: the tile grid (:mod:`tiling`), the halo exchange (:mod:`halo_exchange`), the
tile kernels of the ops a split activation meets (:mod:`kernels`: convolution, pooling, transposed convolution,
interpolation, adaptive pooling, normalisation, over 1-, 2- and 3-D splits), the op dispatch that routes every op
on a split activation to its kernel (:mod:`dispatch`: :class:`~lightning_hpc.spatial.dispatch.SpatialTensor`,
:func:`~lightning_hpc.spatial.dispatch.split_tensor`), the setup-time split check (:mod:`split_check`) and
gradient reduction (:mod:`gradients`).  No layer is replaced: a rank wraps its tile with ``split_tensor`` and runs
the unchanged model.  The Lightning adapter is :mod:`strategy` (imported lazily by the registry).
"""

from lightning_hpc.spatial.halo_exchange import (
    HaloPlan,
    PartitionError,
    Window1d,
    halo_exchange,
)
from lightning_hpc.spatial.tiling import (
    HybridLayout,
    SpatialGrid,
    create_hybrid_layout,
    tile_slices,
)

__all__ = [
    "HaloPlan",
    "HybridLayout",
    "PartitionError",
    "SpatialGrid",
    "Window1d",
    "create_hybrid_layout",
    "halo_exchange",
    "tile_slices",
]

"""Spatial (and hybrid sample x spatial) parallelism for CNNs (Dryden et al., "Improving Strong-Scaling of CNN
Training by Exploiting Finer-Grained Parallelism").

Plain PyTorch + torch.distributed, in layers, each a sub-package importing only those listed before it:

* :mod:`.layout`: the tile grid (:mod:`.layout.tiling`), the halo exchange (:mod:`.layout.halo_exchange`), rows
  moved between tiles, the group collectives and the gradient reduction (:mod:`.layout.gradients`);
* :mod:`.kernels`: the tile kernels of the ops a split activation meets (convolution, pooling, transposed
  convolution, interpolation, adaptive pooling, normalisation, over 1-, 2- and 3-D splits);
* :mod:`.dispatch`: the op dispatch that routes every op on a split activation to its kernel
  (:class:`~lightning_hpc.spatial.dispatch.SpatialTensor`, :func:`~lightning_hpc.spatial.dispatch.split_tensor`),
  the windows each op reads (:mod:`.dispatch.windows`), the setup-time split check (:mod:`.dispatch.split_check`)
  and what K-FAC reads of tiled convolutions (:mod:`.dispatch.kfac_contract`);
* :mod:`.compile`: ``torch.compile`` of a split model, its split step one graph of tile operations (the halo
  exchange and the group sums as the operators of :mod:`.kernels.graph_ops`);
* :mod:`.planner`: the performance model and the search for a split (section V);
* :mod:`.lightning`: the Lightning adapter (:mod:`.lightning.strategy`, imported lazily by the registry, and the
  torchmetrics support :mod:`.lightning.metrics`).

No layer is replaced: a rank wraps its tile with ``split_tensor`` and runs the unchanged model.
"""

from lightning_hpc.spatial.layout.halo_exchange import (
    HaloPlan,
    PartitionError,
    Window1d,
    halo_exchange,
)
from lightning_hpc.spatial.layout.tiling import (
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

"""The layout layer of spatial parallelism: how a sample is split over ranks and how the tiles exchange data
(Dryden et al., section III-A), in plain torch + torch.distributed; it imports no other layer of ``spatial/``.

* :mod:`.tiling`: the tile grid and the hybrid sample x spatial groups (:class:`~.tiling.SpatialGrid`,
  :func:`~.tiling.create_hybrid_layout`, :func:`~.tiling.tile_slices`);
* :mod:`.policy` and :mod:`.decisions`: what a grid carries for the op dispatch (its settings, its decision
  cache);
* :mod:`.halo_exchange`: the halo exchange of 1-, 2- and 3-D splits (section IV-A for its overlap);
* :mod:`.remap`: rows moved between tiles (``out[o] = x[src(o)]`` along one split dimension);
* :mod:`.collectives`: the sum over the spatial group of a value used replicated afterwards;
* :mod:`.gradients`: the gradient reduction of hybrid training (tile parameters summed, the rest averaged).

The layers above it: :mod:`lightning_hpc.spatial.kernels` (tile kernels), :mod:`lightning_hpc.spatial.dispatch`
(the split tensor and its op dispatch), :mod:`lightning_hpc.spatial.planner` and the Lightning adapter
:mod:`lightning_hpc.spatial.lightning`.
"""

"""Tile kernels over 1-, 2- and 3-D spatial splits (Dryden et al., sections III-A and III-B): plain functions of
(local tile, grid, global extents of the split dimensions, weights, the op's arguments) that return this rank's
output tile, blocked over the output's global extents, equal to the serial torch op and autograd-correct
(input, weight and bias gradients; weight and bias gradients are this tile's partial sums, which the caller sums
over the spatial group).  Global poolings (:mod:`adaptive`) return the whole output, replicated.

Each kernel has ONE window function giving, per split dimension, the input range an output range needs (its
halo): the halo plan and a setup-time acceptance check (:func:`check_partition`) use the same function.

* :mod:`convolution`: :func:`conv` (``F.conv1d/2d/3d``), :func:`convolution_windows`
* :mod:`pooling`: :func:`max_pool`, :func:`avg_pool`, :func:`pooling_windows`
* :mod:`transposed`: :func:`conv_transpose` (``F.conv_transpose1d/2d/3d``), :func:`transposed_windows`
* :mod:`interpolation`: :func:`interpolate`, :func:`interpolation_windows`
* :mod:`adaptive`: :func:`adaptive_avg_pool`, :func:`adaptive_max_pool`, :func:`adaptive_windows`
"""

from lightning_hpc.spatial.kernels.adaptive import adaptive_avg_pool, adaptive_max_pool, adaptive_windows
from lightning_hpc.spatial.kernels.convolution import (
    ConvPlan,
    conv,
    convolution_windows,
    plan_conv,
    run_conv,
    tile_convolution_applies,
)
from lightning_hpc.spatial.kernels.interpolation import (
    InterpolationPlan,
    interpolate,
    interpolation_windows,
    plan_interpolation,
    run_interpolation,
)
from lightning_hpc.spatial.kernels.plan import check_partition, halo_plan, largest_split, output_extents
from lightning_hpc.spatial.kernels.pooling import PoolPlan, avg_pool, max_pool, plan_pool, pooling_windows, run_pool
from lightning_hpc.spatial.kernels.transposed import conv_transpose, transposed_windows
from lightning_hpc.spatial.layout.halo_exchange import PartitionError

__all__ = [
    "PartitionError",
    "check_partition",
    "halo_plan",
    "largest_split",
    "output_extents",
    "conv",
    "ConvPlan",
    "plan_conv",
    "run_conv",
    "convolution_windows",
    "tile_convolution_applies",
    "max_pool",
    "avg_pool",
    "PoolPlan",
    "plan_pool",
    "run_pool",
    "pooling_windows",
    "conv_transpose",
    "transposed_windows",
    "interpolate",
    "interpolation_windows",
    "InterpolationPlan",
    "plan_interpolation",
    "run_interpolation",
    "adaptive_avg_pool",
    "adaptive_max_pool",
    "adaptive_windows",
]

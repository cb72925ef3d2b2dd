"""Op dispatch on spatially split activations: every op on a tile either has an exact tiled form, is computed
exactly on the gathered whole activation (with a one-time warning naming the op, the module and the bytes),
or is refused with an error naming the op, the module and what to do.  Nothing runs tile-local by accident.

:class:`SpatialTensor` is a ``torch.Tensor`` subclass holding one tile of an activation blocked over the
spatial grid: grid axis ``k`` splits its dimension ``sdims[k]`` (:func:`lightning_hpc.distributed.partition.
block_bounds` over each; 1, 2 or 3 axes, like DTensor's ``Shard`` placements over a mesh).  Like DTensor it
reports the *global* shape (``x.shape``, ``x.size()``), so user code that derives sizes, paddings, crops or
coordinates from shapes computes what one process computes.  ``__torch_function__`` routes each op:

* **local**: element-wise ops (with broadcasting; a plain operand that spans the whole split extent is cut to
  this tile), ops along dimensions that are not split (softmax/log_softmax, ``F.linear`` on the last dimension,
  ``F.layer_norm`` over unsplit dimensions, ``F.prelu``, ``cat``/``chunk``/``split``/indexing over unsplit
  dimensions, ``permute``/``transpose``), type and device conversions;
* **tiled kernels** (:mod:`lightning_hpc.spatial.kernels`, 1-, 2- and 3-D): ``F.conv1d/2d/3d`` (halo exchange,
  :mod:`~lightning_hpc.spatial.kernels.convolution`), max / average pooling incl. ``ceil_mode``
  (:mod:`~lightning_hpc.spatial.kernels.pooling`), ``F.batch_norm`` (statistics over the whole sample),
  ``F.interpolate`` nearest/linear (:mod:`~lightning_hpc.spatial.kernels.interpolation`), adaptive average /
  max pooling (window sums / maxima over the group, :mod:`~lightning_hpc.spatial.kernels.adaptive`),
  ``F.group_norm``/``F.instance_norm``/``F.layer_norm`` over the split dimensions (statistics over the whole
  sample, :mod:`~lightning_hpc.spatial.kernels.normalization`), transposed convolutions (halo exchange,
  :mod:`~lightning_hpc.spatial.kernels.transposed`), ``F.pad`` in every mode (constant padding and
  negative padding, i.e. crops, too; ``torch.constant_pad_nd``), slicing of split dimensions
  (``x[..., a:b, c:d]``, ``x[..., ::2, ::2]``, ``narrow``) and ``F.pixel_shuffle``/``F.pixel_unshuffle`` (rows
  moved between tiles, :mod:`~lightning_hpc.spatial.layout.remap`);
* **global reductions**: ``sum``/``mean`` over the split dimensions and the losses (``cross_entropy``,
  ``nll_loss``, ``binary_cross_entropy[_with_logits]``, ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
  ``huber_loss``) with ``reduction="mean"``/``"sum"`` are summed over the spatial group and divided by the
  global count, so an unchanged mean loss equals one process's loss;
* **random**: the dropouts, ``rand_like``/``randn_like``, ``bernoulli``/``bernoulli_``, ``uniform_`` and
  ``normal_`` give each tile its part of what one process draws for the whole activation from the same generator
  state, bit for bit (on the CPU each rank holds only its tile's values and a quarter of them more,
  :mod:`.creation`, :mod:`.tile_streams`);
* **anything else** (flips, rolls, integer indices of split dimensions, views that merge split dimensions,
  softmax over positions, ...): the split operands are gathered, the op
  runs on the whole activation exactly as on one process, and a result with the same number of dimensions is
  split again.  With ``on_unsupported="error"`` this raises instead.  In-place ops that cannot be done on a tile
  are always refused.

Gradient convention (:mod:`.autograd`): the gradient of a tile is that tile's part; the gradient of a plain
(replicated) tensor is complete on every rank.  A parameter used both on tiles and on replicated values is
refused (:mod:`.parameter_check`).

Modules: :mod:`.tensor` (the split tensor, making and gathering one), :mod:`.state` (the per-process counters,
the ``on_unsupported`` block, a run's module trace), :mod:`.parameter_check` (parameters used on tiles and on
replicated values), :mod:`.autograd` (the gradient convention's Functions), :mod:`.calls` (reading an op
call), :mod:`.registry` (the handler table and the dispatch entry), the handlers by op family
(:mod:`.elementwise`, :mod:`.metadata`, :mod:`.creation`, :mod:`.local`, :mod:`.shape`, :mod:`.reductions`,
:mod:`.losses`, :mod:`.norms`, :mod:`.kernels`, :mod:`.relayout`, :mod:`.backward`) and the gather path
(:mod:`.fallback`).
"""

from __future__ import annotations

# the handler modules register their ops with the registry on import
from lightning_hpc.spatial.dispatch import (  # noqa: F401
    backward,
    creation,
    elementwise,
    flat,
    kernels,
    local,
    losses,
    metadata,
    norms,
    reductions,
    relayout,
    shape,
)
from lightning_hpc.spatial.dispatch.autograd import _tile_index as _tile_index
from lightning_hpc.spatial.dispatch.parameter_check import ParameterUseCheck as ParameterUseCheck
from lightning_hpc.spatial.dispatch.state import DispatchState, SpatialDispatchError, state
from lightning_hpc.spatial.dispatch.state import on_unsupported as on_unsupported
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, gather_tensor, local_tile, split_tensor
from lightning_hpc.spatial.dispatch.tensor import _plain as _plain

__all__ = [
    "SpatialTensor", "SpatialDispatchError", "DispatchState", "split_tensor", "gather_tensor", "local_tile", "state",
]

"""What K-FAC reads of a convolution whose input is split (the contract of
:class:`lightning_hpc.kfac.layers.TiledConvHandler`), without replacing the layer.

K-FAC's factors of a convolution are sums over the output positions of the input patches (KFC, Grosse & Martens
2016); on a tile, this rank's share is the patches of the halo- and border-padded input box whose convolution
with padding 0 gives exactly the outputs the tile owns.  The strategy declares each ``nn.Conv1d`` / ``nn.Conv2d``
/ ``nn.Conv3d`` of the model (plain instance attributes, the layer stays what it is):

* ``kfac_partition_size``: ranks whose tiles make up one sample (their factors are partial sums over them);
* ``kfac_record_input``: set by K-FAC before a forward whose statistics it captures;
* ``kfac_padded_input`` / ``kfac_output_extent``: what that forward recorded: the box and the global output
  extents (for the whole-sample normalisation).

Normalisation layers are declared too (``kfac_split_statistics``): on a split activation their per-sample gradients
are partial sums over the tiles and their statistics the whole sample's, which K-FAC's 2x2 blocks of the scale
and shift cannot use, so K-FAC leaves them to the optimizer with that reason.

The op dispatch's convolution handler records the box the tile kernel builds
(:func:`lightning_hpc.spatial.kernels.conv`'s ``record``, :func:`lightning_hpc.spatial.dispatch.kernels.
kfac_recorder`) when the calling layer asks; an input that is not split (after a global pooling) is recorded
here, padded as the layer pads it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.tensor import SpatialTensor
from lightning_hpc.spatial.kernels import convolution_windows

__all__ = ["declare_tiled_convolutions"]


def _record_whole_input(module: nn.Conv1d | nn.Conv2d | nn.Conv3d, args: tuple, output: object) -> None:
    """After the layer ran on an input that is not split: record it padded as the layer pads it.  A forward hook put
    before all others: it runs after K-FAC's pre-hook asked for the record and before K-FAC's forward hook reads
    it, whether the declaration or K-FAC's hooks came first."""
    x = args[0] if args else None
    if not getattr(module, "kfac_record_input", False) or not isinstance(x, torch.Tensor) or x.dim() < 3:
        return
    if isinstance(x, SpatialTensor) or module.padding_mode != "zeros":
        return  # a split input: the convolution handler records the tile's box
    windows = convolution_windows(module.weight.shape, module.stride, module.padding, module.dilation)
    vars(module).update(kfac_padded_input=F.pad(x, module._reversed_padding_repeated_twice).detach(),
                        kfac_output_extent=tuple(w.out_size(int(n)) for w, n in zip(windows, x.shape[2:])))


#: normalisation layers: their statistics (and so their per-sample scale and shift gradients) span every tile
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm1d,
          nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm, nn.RMSNorm)


def declare_tiled_convolutions(model: nn.Module, partition_size: int) -> list[Any]:
    """Declare every convolution of ``model`` to K-FAC as a tiled convolution (module docstring), and every
    normalisation layer as one whose statistics span the tiles (``kfac_split_statistics``: K-FAC leaves its
    affine parameters to the optimizer, saying why), before K-FAC's preconditioner is made (it picks its tiled
    handler by these attributes); returns the hook handles (recording an input that is not split)."""
    handles = []
    for m in model.modules():
        if isinstance(m, _NORMS):
            vars(m)["kfac_split_statistics"] = True
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            # plain attributes in the instance (not parameters or buffers: nothing a state_dict carries)
            vars(m).update(kfac_partition_size=partition_size, kfac_record_input=False, kfac_padded_input=None,
                           kfac_output_extent=None)
            handles.append(m.register_forward_hook(_record_whole_input, prepend=True))
    return handles

"""What K-FAC reads of the convolutions whose input is split (the :class:`~lightning_hpc.protocols.TiledLayers`
contract of :class:`lightning_hpc.kfac.layers.TiledConvHandler`), without replacing a layer or writing onto it.

K-FAC's factors of a convolution are sums over the output positions of the input patches (KFC, Grosse & Martens
2016); on a tile, this rank's share is the patches of the halo- and border-padded input box whose convolution
with padding 0 gives exactly the outputs the tile owns.  The strategy keeps a :class:`TiledLayerRegistry` of the
model's ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` (tiled: their factors are partial sums over
``partition_size`` ranks) and normalisation layers (their per-sample gradients are partial sums over the tiles and
their statistics the whole sample's, which K-FAC's 2x2 blocks of the scale and shift cannot use, so K-FAC leaves
them to the optimizer with that reason), hands it to K-FAC (``StrategyContract.kfac_tiled_layers``) and to the op
dispatch through the grid its split tensors carry (``SpatialGrid.tiled_layers``).

On a step whose statistics K-FAC captures, it asks the registry to record a layer's input (:meth:`request`); the
op dispatch's convolution handler then records the box the tile kernel builds
(:func:`lightning_hpc.spatial.kernels.conv`'s ``record``) for the call on that layer's weight, and K-FAC takes it
after the forward (:meth:`take`).  An input that is not split (after a global pooling) is padded there as the
layer pads it.  Everything lives in the registry, which belongs to one strategy: the user's modules carry no
attribute and no hook of it, and a later run of the same modules (another Trainer, a plain run) sees none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.tensor import SpatialTensor
from lightning_hpc.spatial.kernels import convolution_windows

__all__ = ["TiledLayerRegistry", "declare_tiled_convolutions"]

#: normalisation layers: their statistics (and so their per-sample scale and shift gradients) span every tile
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm1d,
          nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm, nn.RMSNorm)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

#: what a record holds: the padded input box and the whole sample's output extent
Record = tuple[torch.Tensor, tuple[int, ...]]


class TiledLayerRegistry:
    """The tiled convolutions and split-statistics normalisation layers of one strategy's model, and the input
    boxes recorded for K-FAC (:class:`~lightning_hpc.protocols.TiledLayers`).  Layers are held by identity."""

    def __init__(self, partition_size: int) -> None:
        #: ranks whose tiles make up one sample (the tiled layers' factors are partial sums over them)
        self.partition_size = int(partition_size)
        self._convolutions: dict[int, nn.Module] = {}
        self._norms: dict[int, nn.Module] = {}
        #: the layers asked to record, by ``id`` of their weight (what the convolution handler sees of its caller)
        self._requested: dict[int, nn.Module] = {}
        self._records: dict[int, Record] = {}

    def declare(self, model: nn.Module) -> TiledLayerRegistry:
        """Add every convolution and normalisation layer of ``model``; returns the registry."""
        for m in model.modules():
            if isinstance(m, _NORMS):
                self._norms[id(m)] = m
            if isinstance(m, _CONVOLUTIONS):
                self._convolutions[id(m)] = m
        return self

    def is_tiled(self, module: Any) -> bool:
        return self._convolutions.get(id(module)) is module

    def splits_statistics(self, module: Any) -> bool:
        return self._norms.get(id(module)) is module

    def request(self, module: Any, capturing: bool) -> None:
        """K-FAC, before the layer's forward: record its input box in this forward (``capturing``), or not."""
        self._records.pop(id(module), None)
        if capturing:
            self._requested[id(module.weight)] = module
        else:
            self._requested.pop(id(module.weight), None)

    def recorder(self, weight: torch.Tensor) -> Callable[[torch.Tensor, tuple[int, ...]], None] | None:
        """The tile kernel's ``record`` callback for the convolution on ``weight`` while K-FAC captures that layer's
        statistics, else None (called by the op dispatch's convolution handler)."""
        module = self._requested.get(id(weight))
        if module is None or module.weight is not weight:
            return None

        def record(box: torch.Tensor, extent: tuple[int, ...]) -> None:
            self._records[id(module)] = (box.detach(), tuple(int(n) for n in extent))

        return record

    def take(self, module: Any, inputs: tuple) -> Record | None:
        """After the layer's forward: the recorded box and whole-sample output extent (None when the forward was
        not asked to record), and the request ended.  An input that is not split is the whole sample: its box is
        the input padded as the layer pads it."""
        requested = self._requested.pop(id(module.weight), None) is module
        record = self._records.pop(id(module), None)
        if record is not None or not requested:
            return record
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor) or isinstance(x, SpatialTensor) or x.dim() < 3:
            return None  # a split input the tile kernel did not run (the gathered path): nothing recorded
        if module.padding_mode != "zeros":
            return None
        windows = convolution_windows(module.weight.shape, module.stride, module.padding, module.dilation)
        return (F.pad(x, module._reversed_padding_repeated_twice).detach(),
                tuple(w.out_size(int(n)) for w, n in zip(windows, x.shape[2:])))


def declare_tiled_convolutions(model: nn.Module, partition_size: int, grid: Any = None) -> TiledLayerRegistry:
    """A :class:`TiledLayerRegistry` of ``model``'s convolutions and normalisation layers over ``partition_size``
    ranks per sample, made known to the op dispatch of ``grid``'s split tensors (``grid.tiled_layers``) when one is
    given; hand it to K-FAC (``KFACPreconditioner(..., tiled_layers=...)``).  Nothing is written onto ``model``."""
    registry = TiledLayerRegistry(partition_size).declare(model)
    if grid is not None:
        grid.tiled_layers = registry
    return registry

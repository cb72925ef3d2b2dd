"""Per-layer K-FAC handlers, one file per layer family, and the choice of a module's handler (:func:`make_handler`).

A handler owns one layer's statistics, factors and decompositions and how its gradient is preconditioned with them:

* :mod:`.base`: :class:`LayerHandler`, common to all, and the scaling convention of the factors;
* :mod:`.linear`: ``nn.Linear`` (Martens & Grosse 2015);
* :mod:`.sharded`: hybrid_fc's sharded head, preconditioned as the whole Linear layer;
* :mod:`.conv`: ``nn.Conv1d/2d/3d`` (KFC, Grosse & Martens 2016);
* :mod:`.tiled`: a convolution on one spatial tile of each sample (spatial parallelism);
* :mod:`.transposed`: ``nn.ConvTranspose1d/2d/3d`` (KFC with its sides swapped);
* :mod:`.grouped`: grouped (transposed) convolutions, a block per group, all groups batched;
* :mod:`.norm`: normalisation layers' affine parameters (a 2x2 block per channel, KFAC-JAX's scale and shift);
* :mod:`.embedding`: ``nn.Embedding`` (a diagonal A).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.conv import CONVOLUTIONS, ConvHandler
from lightning_hpc.kfac.layers.embedding import EmbeddingHandler
from lightning_hpc.kfac.layers.grouped import GroupConvHandler, GroupConvTransposeHandler
from lightning_hpc.kfac.layers.linear import LinearHandler, linear_batch_dim
from lightning_hpc.kfac.layers.norm import FEATURE_NORMS, NORMS, NormAffineHandler
from lightning_hpc.kfac.layers.sharded import ShardedLinearHandler
from lightning_hpc.kfac.layers.tiled import TiledConvHandler
from lightning_hpc.kfac.layers.transposed import TRANSPOSED_CONVOLUTIONS, ConvTransposeHandler
from lightning_hpc.protocols import ShardedFullyConnected

__all__ = [
    "CONVOLUTIONS",
    "FEATURE_NORMS",
    "LAYER_TYPES",
    "NORMS",
    "SUPPORTED",
    "TRANSPOSED_CONVOLUTIONS",
    "ConvHandler",
    "ConvTransposeHandler",
    "EmbeddingHandler",
    "GroupConvHandler",
    "GroupConvTransposeHandler",
    "LayerHandler",
    "LinearHandler",
    "NormAffineHandler",
    "ShardedLinearHandler",
    "TiledConvHandler",
    "base_type",
    "layer_type_of",
    "linear_batch_dim",
    "make_handler",
]

#: module types K-FAC preconditions; every other layer is left to the optimizer
SUPPORTED = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.Embedding,
)  # fmt: skip


#: ``layer_types`` names: the module types of each family K-FAC can precondition
LAYER_TYPES: dict[str, tuple[type[nn.Module], ...]] = {
    "linear": (nn.Linear,),
    "conv": CONVOLUTIONS,
    "conv_transpose": TRANSPOSED_CONVOLUTIONS,
    "norm": NORMS,
    "embedding": (nn.Embedding,),
}


def base_type(module: nn.Module) -> type[nn.Module] | None:
    """The class of :data:`SUPPORTED` that ``module`` is an instance of, nearest in its method resolution order
    (None: none, or a sharded fully-connected layer, which is not a subclass of a torch layer)."""
    if isinstance(module, ShardedFullyConnected):
        return None
    return next((cls for cls in type(module).__mro__ if cls in SUPPORTED), None)


def layer_type_of(module: nn.Module) -> str | None:
    """The ``layer_types`` family of ``module`` (None: not one K-FAC handles); a sharded fully-connected layer
    (:class:`~lightning_hpc.protocols.ShardedFullyConnected`) is a ``"linear"``."""
    if isinstance(module, ShardedFullyConnected):
        return "linear"
    return next((name for name, types in LAYER_TYPES.items() if isinstance(module, types)), None)


def make_handler(name: str, module: nn.Module) -> LayerHandler | None:
    """The handler of a supported module, else None.

    A Conv2d offering the tiled-input protocol (``kfac_padded_input``, see :class:`TiledConvHandler`) gets the
    tiled handler: its input is one tile of a spatially partitioned sample."""
    if isinstance(module, ShardedFullyConnected):
        return ShardedLinearHandler(name, module)
    if isinstance(module, nn.Linear):
        return LinearHandler(name, module)
    if isinstance(module, CONVOLUTIONS):
        tiled = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and hasattr(module, "kfac_padded_input")
        if module.groups > 1:  # tiled grouped convolutions are left out (discovery.skip_reason says why)
            return None if tiled else GroupConvHandler(name, module)
        if tiled:
            return TiledConvHandler(name, module)
        return ConvHandler(name, module)
    if isinstance(module, TRANSPOSED_CONVOLUTIONS):
        if module.groups > 1:
            return GroupConvTransposeHandler(name, module)
        return ConvTransposeHandler(name, module)
    if isinstance(module, NORMS) and isinstance(getattr(module, "weight", None), torch.Tensor):
        return NormAffineHandler(name, module)
    if isinstance(module, nn.Embedding):
        return EmbeddingHandler(name, module)
    return None

"""Per-layer K-FAC handlers, one file per layer family, and the registration table that maps module types to them
(:data:`REGISTRY`, :func:`make_handler`).

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

A new layer type is a handler file of its own (a :class:`LayerHandler` subclass: its rows or Grams, factor forms,
gradient matrix and, where it is not the Kronecker form, its preconditioning) and one :class:`LayerType` line in
:data:`REGISTRY`: the ``layer_types`` names (:data:`LAYER_TYPES`), the supported types (:data:`SUPPORTED`), the
handler choice and the reasons for leaving a module out all come from the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.conv import CONVOLUTIONS, ConvHandler
from lightning_hpc.kfac.layers.embedding import EmbeddingHandler, embedding_refusal
from lightning_hpc.kfac.layers.grouped import GroupConvHandler, GroupConvTransposeHandler
from lightning_hpc.kfac.layers.linear import LinearHandler, linear_batch_dim
from lightning_hpc.kfac.layers.norm import FEATURE_NORMS, NORMS, NormAffineHandler, norm_refusal
from lightning_hpc.kfac.layers.sharded import ShardedLinearHandler
from lightning_hpc.kfac.layers.tiled import TiledConvHandler
from lightning_hpc.kfac.layers.transposed import TRANSPOSED_CONVOLUTIONS, ConvTransposeHandler
from lightning_hpc.protocols import ShardedFullyConnected, TiledLayers

__all__ = [
    "CONVOLUTIONS",
    "FEATURE_NORMS",
    "LAYER_TYPES",
    "NORMS",
    "REGISTRY",
    "SUPPORTED",
    "TRANSPOSED_CONVOLUTIONS",
    "ConvHandler",
    "ConvTransposeHandler",
    "EmbeddingHandler",
    "GroupConvHandler",
    "GroupConvTransposeHandler",
    "LayerHandler",
    "LayerType",
    "LinearHandler",
    "NormAffineHandler",
    "ShardedLinearHandler",
    "TiledConvHandler",
    "base_type",
    "layer_type_of",
    "linear_batch_dim",
    "make_handler",
    "refusal_of",
    "registration_of",
    "supported_text",
]


def _accepted(module: nn.Module) -> str | None:
    return None


@dataclass(frozen=True)
class LayerType:
    """One row of the registration table: the module ``types`` of a ``layer_types`` ``family``, the handler a
    module of them gets (``make(name, module)``; a :class:`LayerHandler` subclass or a function choosing one), why
    such a module is left to the optimizer (``refusal(module)``, None: it is not) and the ``label`` the report's
    list of supported types shows."""

    family: str
    types: tuple[type[nn.Module], ...]
    make: Callable[[str, nn.Module], LayerHandler]
    label: str
    refusal: Callable[[nn.Module], str | None] = _accepted


def _tiled(module: nn.Module, tiled: TiledLayers | None) -> bool:
    """A convolution the strategy's :class:`~lightning_hpc.protocols.TiledLayers` names: its input is one tile of
    a spatially partitioned sample."""
    return tiled is not None and isinstance(module, CONVOLUTIONS) and tiled.is_tiled(module)


def _conv_handler(name: str, module: nn.Module) -> LayerHandler:
    if module.groups > 1:  # type: ignore[operator]
        return GroupConvHandler(name, module)  # type: ignore[arg-type]
    return ConvHandler(name, module)


def _conv_transpose_handler(name: str, module: nn.Module) -> LayerHandler:
    if module.groups > 1:  # type: ignore[operator]
        return GroupConvTransposeHandler(name, module)
    return ConvTransposeHandler(name, module)


#: the registration table, in matching order (a module gets the first row whose types it is an instance of)
REGISTRY: tuple[LayerType, ...] = (
    LayerType("linear", (nn.Linear,), LinearHandler, "nn.Linear"),
    LayerType("conv", CONVOLUTIONS, _conv_handler, "nn.Conv1d/2d/3d"),
    LayerType("conv_transpose", TRANSPOSED_CONVOLUTIONS, _conv_transpose_handler, "nn.ConvTranspose1d/2d/3d"),
    LayerType("norm", NORMS, NormAffineHandler, "nn.BatchNorm1d/2d/3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, "
              "nn.InstanceNorm1d/2d/3d", norm_refusal),
    LayerType("embedding", (nn.Embedding,), EmbeddingHandler, "nn.Embedding", embedding_refusal),
)

#: module types K-FAC preconditions; every other layer is left to the optimizer
SUPPORTED: tuple[type[nn.Module], ...] = tuple(t for row in REGISTRY for t in row.types)

#: ``layer_types`` names: the module types of each family K-FAC can precondition
LAYER_TYPES: dict[str, tuple[type[nn.Module], ...]] = {}
for _row in REGISTRY:
    LAYER_TYPES[_row.family] = LAYER_TYPES.get(_row.family, ()) + _row.types


def supported_text() -> str:
    """The supported types as the report lists them (``nn.Linear, ... and nn.Embedding``)."""
    labels = [row.label for row in REGISTRY]
    return ", ".join(labels[:-1]) + " and " + labels[-1]


def registration_of(module: nn.Module) -> LayerType | None:
    """The row of :data:`REGISTRY` for ``module`` (None: not a registered type)."""
    return next((row for row in REGISTRY if isinstance(module, row.types)), None)


def refusal_of(module: nn.Module, tiled: TiledLayers | None = None) -> str | None:
    """Why a module of a registered type is left to the optimizer for what it is (its row's ``refusal``, or a
    grouped convolution among the strategy's ``tiled`` layers)."""
    if _tiled(module, tiled) and module.groups > 1:  # type: ignore[operator]
        return f"grouped convolution (groups={module.groups}) on spatial tiles is not supported"
    row = registration_of(module)
    return None if row is None else row.refusal(module)


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


def make_handler(name: str, module: nn.Module, tiled: TiledLayers | None = None) -> LayerHandler | None:
    """The handler of a supported module (its :data:`REGISTRY` row's), else None (also when it is refused).

    A convolution the strategy's ``tiled`` layers name (:class:`~lightning_hpc.protocols.TiledLayers`) gets the
    tiled handler: its input is one tile of a spatially partitioned sample. A sharded fully-connected layer
    (hybrid_fc's head) gets :class:`ShardedLinearHandler`."""
    if isinstance(module, ShardedFullyConnected):
        return ShardedLinearHandler(name, module)
    row = registration_of(module)
    if row is None or refusal_of(module, tiled) is not None:
        return None
    if _tiled(module, tiled):
        assert tiled is not None
        return TiledConvHandler(name, module, tiled)
    return row.make(name, module)

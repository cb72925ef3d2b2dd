"""Convert a model's layers to their spatially partitioned versions, with setup-time validation.

:func:`convert_model` replaces, in place, every Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d (aggregated or
tile-local), Upsample and global AdaptiveAvgPool2d by the spatial layer sharing its parameters and buffers (an
optimizer built before or after conversion holds the same Parameter objects).  Element-wise layers need
nothing (section III-B).  Before anything runs, :func:`trace_input_shapes` propagates the global input shape
through the model on the meta device (no memory, no compute) and :func:`validate_partition` checks that every
layer can be split the requested way; a layer that cannot (a tile smaller than the halo it needs, fewer rows
than parts) raises :class:`PartitionError` naming the layer, its input size and the largest partition that
works for it.  Layers the converter does not know raise as well, rather than silently computing something
else on a tile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpc.spatial.batchnorm import BN_MODES, SpatialBatchNorm2d
from lightning_hpc.spatial.conv import SpatialConv2d
from lightning_hpc.spatial.halo_exchange import PartitionError
from lightning_hpc.spatial.heads import SpatialGlobalAvgPool2d
from lightning_hpc.spatial.layer import SpatialContext, SpatialLayer
from lightning_hpc.spatial.pooling import SpatialAvgPool2d, SpatialMaxPool2d
from lightning_hpc.spatial.tiling import SpatialGrid
from lightning_hpc.spatial.upsample import SpatialUpsample

__all__ = [
    "convert_model",
    "validate_partition",
    "trace_input_shapes",
    "split_parameters",
    "ELEMENTWISE",
    "REPLICATED",
]

#: layers that act per element (or per pixel across channels) and run unchanged on a tile
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Identity, nn.Dropout, nn.Softmax,
    nn.LogSoftmax, nn.Softmax2d,
)
#: layers that only make sense after a global pooling (input already replicated over the spatial group)
REPLICATED: tuple[type[nn.Module], ...] = (nn.Linear, nn.Flatten)
#: modules that are not layers of the network (losses compute on whatever the module gives them)
_NOT_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.loss._Loss,)

_CONVERTERS = {
    nn.Conv2d: SpatialConv2d,
    nn.MaxPool2d: SpatialMaxPool2d,
    nn.AvgPool2d: SpatialAvgPool2d,
    nn.BatchNorm2d: SpatialBatchNorm2d,
    nn.Upsample: SpatialUpsample,
    nn.AdaptiveAvgPool2d: SpatialGlobalAvgPool2d,
}


def _spatial_class(m: nn.Module) -> type[Any] | None:
    if isinstance(m, SpatialLayer):
        return None
    for base, cls in _CONVERTERS.items():
        if type(m) is base:
            return cls
    return None


def trace_input_shapes(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Input shape of every leaf module for one global sample of ``input_shape`` (C, H, W), traced on the meta
    device (nothing allocated, nothing computed)."""
    shapes: dict[str, tuple[int, ...]] = {}
    handles = []
    for name, m in model.named_modules():
        if len(list(m.children())) == 0:
            def hook(mod, args, name=name):
                if args and isinstance(args[0], torch.Tensor):
                    shapes.setdefault(name, tuple(args[0].shape))
            handles.append(m.register_forward_pre_hook(hook))
    state = {
        k: torch.empty_like(v, device="meta") for k, v in list(model.named_parameters()) + list(model.named_buffers())
    }
    modes = {m: m.training for m in model.modules()}
    model.eval()  # shapes do not depend on the mode; training-mode batch norm with momentum=None reads a counter
    try:
        with torch.no_grad():
            torch.func.functional_call(model, state, (torch.empty((1, *input_shape), device="meta"),))
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.train(mode)
    return shapes


def validate_partition(
    model: nn.Module, input_shape: Sequence[int], parts: tuple[int, ...], *, dispatch: bool = False
) -> dict[str, tuple[int, ...]]:
    """Raise :class:`PartitionError` for the first layer that cannot be split ``parts`` with a global input of
    ``input_shape`` = (C, H, W); returns the traced input shape of every leaf layer."""
    shapes = trace_input_shapes(model, input_shape)
    probe = SpatialGrid(parts=(parts[0], parts[1]), ranks=list(range(parts[0] * parts[1])), group=None, local_rank=0)
    for name, m in model.named_modules():
        if name not in shapes:
            continue
        shape = shapes[name]
        cls: type[Any] | None = _spatial_class(m) or (type(m) if isinstance(m, SpatialLayer) else None)
        if dispatch and not isinstance(m, SpatialLayer) and cls is not None and not _convertible(m):
            continue
        if cls is None or len(shape) != 4:
            continue
        layer = cls.from_module(m, probe, name=name) if not isinstance(m, SpatialLayer) else m
        h, w = shape[-2:]
        if dispatch and (h < parts[0] or w < parts[1]):
            continue  # after a global pooling: not split, the serial layer runs (a split input fails at the op)
        # DimPlan checks every tile of the grid, not just this rank's
        if h < parts[0] or w < parts[1]:
            raise layer.partition_error(h, w, "the input has fewer rows/columns than parts")
        layer._plans = {}
        layer.grid = probe
        layer.halo_plan(h, w)
    return shapes


def convert_model(
    model: nn.Module,
    grid: SpatialGrid,
    *,
    overlap: bool = False,
    batchnorm: str = "aggregated",
    input_shape: Sequence[int] | None = None,
    allow: Iterable[type[nn.Module]] = (),
    dispatch: bool = False,
) -> nn.Module:
    """Replace the layers of ``model`` in place by their spatial versions on ``grid``; returns ``model``.

    ``input_shape`` (C, H, W of one global sample), when given, validates the partition first.  ``allow`` adds
    leaf module types known to be correct on tiles (element-wise custom layers).

    ``dispatch=True`` (the strategy's mode): activations are :class:`~lightning_hpc.spatial.dispatch.SpatialTensor`
    objects that route every op themselves, so only the exact types above are replaced (for speed and K-FAC's
    tiled handler), anything else is left to the op dispatch (no refusal by module type here), and a plain input
    to a converted layer is treated as replicated (the serial layer runs on it).
    """
    if batchnorm not in BN_MODES:
        raise ValueError(f"batchnorm={batchnorm!r}: choose one of {BN_MODES}")
    if input_shape is not None:
        validate_partition(model, input_shape, grid.parts)
    allowed = ELEMENTWISE + REPLICATED + _NOT_LAYERS + tuple(allow)
    context = SpatialContext(grid)
    converted = 0
    for name, m in list(model.named_modules()):
        if len(list(m.children())) or isinstance(m, SpatialLayer):
            continue
        cls = _spatial_class(m)
        if dispatch and cls is not None and not _convertible(m):
            continue  # left to the op dispatch (e.g. padding_mode='reflect', return_indices=True)
        if cls is None:
            if dispatch or isinstance(m, allowed) or not _is_layer(m):
                continue
            raise PartitionError(
                f"layer '{name}' ({type(m).__name__}) has no spatially partitioned version: it would compute something "
                f"different on a tile than on the whole sample. Supported: Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d, "
                f"Upsample, AdaptiveAvgPool2d(1) and element-wise layers; pass allow=[{type(m).__name__}] if it is "
                f"element-wise"
            )
        if cls is SpatialBatchNorm2d and batchnorm == "local":
            continue
        if cls is SpatialConv2d:
            new = SpatialConv2d.from_module(m, grid, overlap=overlap, name=name)
        else:
            new = cls.from_module(m, grid, name=name)
        new.spatial_context = context
        new.spatial_dispatch = dispatch
        converted += 1
        _set_submodule(model, name, new)
    if converted and grid.size > 1 and not dispatch:
        # one extent allreduce per forward of the model instead of one per layer call
        model.register_forward_pre_hook(context.pre_hook)
        model.register_forward_hook(context.post_hook)
    return model


def _convertible(m: nn.Module) -> bool:
    """Settings the converted layers implement (others are left to the op dispatch)."""
    if isinstance(m, nn.Conv2d):
        return m.padding_mode == "zeros" and not (isinstance(m.padding, str) and m.padding == "same" and
                                                   any(d * (k - 1) % 2 for d, k in zip(m.dilation, m.kernel_size)))
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        return not (getattr(m, "return_indices", False) or getattr(m, "divisor_override", None) is not None)
    if isinstance(m, nn.Upsample):
        return m.mode in ("nearest", "bilinear") and not getattr(m, "recompute_scale_factor", None)
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return m.output_size in (1, (1, 1), [1, 1])
    return True


def _is_layer(m: nn.Module) -> bool:
    """Containers and modules without computation of their own (e.g. torchmetrics) are skipped."""
    return type(m).__module__.startswith("torch.nn")


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(tile, replicated)`` parameters: gradients of parameters used on tiles are partial sums over the
    spatial group (Eq. 2 restricted to a tile); those of layers after a global pooling (Linear heads) are
    complete on every rank."""
    tile: list[nn.Parameter] = []
    replicated: list[nn.Parameter] = []
    seen = set()
    for m in model.modules():
        target = replicated if isinstance(m, REPLICATED) else tile
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                target.append(p)
    return tile, replicated

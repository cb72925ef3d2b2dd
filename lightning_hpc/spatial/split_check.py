"""The setup-time check of a split (the strategy runs it before the first step when the input shape is known).

One global sample is traced through the model on the meta device (nothing allocated, nothing computed); every
layer whose windows read neighbouring rows (:mod:`lightning_hpc.spatial.windows`: convolutions, transposed
convolutions, pools, interpolation, in 1-3 dimensions) is checked with the halo plan's own test
(:class:`~lightning_hpc.spatial.halo_exchange.DimPlan`), the test the tiled kernels and the planner apply: a split
that leaves a tile thinner than a layer's halo, or fewer rows than tiles, is refused naming the layer, the
dimension and the largest split of that dimension that works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_hpc.spatial.halo_exchange import PartitionError
from lightning_hpc.spatial.kernels.plan import dim_names
from lightning_hpc.spatial.tiling import parts_text
from lightning_hpc.spatial.windows import layer_windows, split_works

__all__ = ["check_split", "trace_shapes"]

#: layers whose output is replicated over the spatial group, whatever its extent (partial window sums or maxima
#: combined over the group)
_REPLICATED_OUTPUT = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


def trace_shapes(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(input shape, output shape)`` of every leaf module's first call for one sample of ``input_shape``
    (C, *spatial), traced on the meta device."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    handles = []
    for name, m in model.named_modules():
        if next(m.children(), None) is None:
            def hook(mod, args, out, name=name):
                if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                    shapes.setdefault(name, (tuple(args[0].shape), tuple(out.shape)))
            handles.append(m.register_forward_hook(hook))
    state = {k: torch.empty_like(v, device="meta")
             for k, v in list(model.named_parameters()) + list(model.named_buffers())}
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


def check_split(model: nn.Module, input_shape: Sequence[int], parts: Sequence[int]) -> None:
    """Raise :class:`PartitionError` (or ``ValueError`` for a split of the wrong number of dimensions) for the first
    layer of ``model`` that cannot run on one sample of ``input_shape`` = (C, *spatial) split ``parts``."""
    k = len(parts)
    if len(input_shape) != 1 + k:
        raise ValueError(
            f"spatial_parts={parts_text(parts)} splits {k} spatial dimension(s), but one sample has shape "
            f"{tuple(input_shape)} (channels and {len(input_shape) - 1} spatial dimension(s)); give one part per "
            f"spatial dimension: {dim_names(len(input_shape) - 1)}"
        )
    names = dim_names(k)
    for name, (in_shape, out_shape) in trace_shapes(model, input_shape).items():
        if len(in_shape) != 2 + k or any(n < p for n, p in zip(in_shape[2:], parts)):
            continue  # not an activation of the sample's layout, or one after a global pooling (not split)
        module = model.get_submodule(name)
        if isinstance(module, _REPLICATED_OUTPUT):
            continue
        windows = layer_windows(module, in_shape, out_shape)
        for axis, (n, p) in enumerate(zip(in_shape[2:], parts)):
            window = (windows[axis],) if windows else None
            n_out = out_shape[2 + axis] if len(out_shape) == 2 + k else n
            if split_works(window, (n,), (p,)) and (len(out_shape) != 2 + k or n_out >= p):
                continue
            best = max(q for q in range(1, p + 1) if split_works(window, (n,), (q,)) and n_out >= q)
            suggestion = list(parts)
            suggestion[axis] = best
            reason = (f"its output of {n_out} rows has fewer rows than the {p} parts" if n_out < p else
                      f"a tile of {n // p} rows is thinner than the halo the layer reads")
            raise PartitionError(
                f"layer '{name}' ({type(module).__name__}) with input {'x'.join(map(str, in_shape[2:]))} "
                f"({' x '.join(names)}) cannot be split {parts_text(parts)}: along {names[axis]} {reason}. The "
                f"largest split of {names[axis]} that works for this layer is {best} (e.g. spatial_parts="
                f"{suggestion}); or use a larger input"
            )

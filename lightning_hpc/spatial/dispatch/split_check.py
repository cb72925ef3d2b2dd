"""The setup-time check of a split (the strategy runs it before the first step when the input shape is known).

One global sample is traced through the model on the meta device (nothing allocated, nothing computed); every
layer whose windows read neighbouring rows (:mod:`lightning_hpc.spatial.dispatch.windows`: convolutions, transposed
convolutions, pools, interpolation, in 1-3 dimensions) is checked with the halo plan's own test
(:class:`~lightning_hpc.spatial.layout.halo_exchange.DimPlan`), the test the tiled kernels and the planner apply: a
split that leaves a tile thinner than a layer's halo, or fewer rows than tiles, is refused naming the layer, the
dimension and the largest split of that dimension that works.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hpc.spatial.dispatch.windows import layer_windows, split_works
from lightning_hpc.spatial.kernels.plan import dim_names
from lightning_hpc.spatial.layout.halo_exchange import PartitionError
from lightning_hpc.spatial.layout.tiling import parts_text

__all__ = ["ShapeTraceError", "check_split", "trace_shapes"]

#: layers whose output is replicated over the spatial group, whatever its extent (partial window sums or maxima
#: combined over the group)
_REPLICATED_OUTPUT = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


class ShapeTraceError(RuntimeError):
    """The meta-device trace of one sample failed in a layer (an op without a meta kernel, a value read on the
    host, ...); the model is left exactly as it was, and the strategy checks the split at the first step instead."""


def _stand_in(t: Tensor) -> Tensor:
    """A meta tensor of ``t``'s shape, dtype and kind (a parameter stays a parameter: layers may test for one)."""
    m = torch.empty_like(t, device="meta")
    return nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m


@contextlib.contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``model`` replaced by a meta stand-in for the duration, then the very same
    objects put back, whatever the trace did.

    Each module's own slots are swapped once (``modules()`` lists a submodule registered under several names
    once), and one tensor held in several slots (tied weights) gets one stand-in, so it stays tied during the
    trace. ``torch.func.functional_call`` swaps per *name* instead: a submodule registered under two names is
    swapped twice, the second swap saves the first one's meta tensor as the "original" and puts it back on exit,
    which left such models on the meta device. Parametrizations need nothing special: their ``original`` is a
    parameter of a submodule like any other. Plain tensor attributes (the ``weight`` the hook forms
    ``nn.utils.weight_norm``/``spectral_norm`` compute, a table a layer made at its first call) get stand-ins too
    (a meta activation cannot meet a real tensor) and are put back; ones the trace added are removed, so a layer
    that caches at its first call makes its cache again at the first real call.
    """
    stand_ins: dict[int, Tensor] = {}
    saved: list[tuple[dict[str, Any], str, Tensor]] = []  # (where, key, the original object)
    had: list[tuple[nn.Module, set[str]]] = []
    try:
        for m in model.modules():
            had.append((m, set(vars(m))))
            attributes = [k for k, v in vars(m).items() if isinstance(v, Tensor)]
            places: list[tuple[dict[str, Any], list[str]]] = [
                (m._parameters, list(m._parameters)), (m._buffers, list(m._buffers)), (vars(m), attributes)]
            for slots, keys in places:
                for k in keys:
                    v = slots[k]
                    if v is None:
                        continue
                    saved.append((slots, k, v))
                    if id(v) not in stand_ins:
                        stand_ins[id(v)] = _stand_in(v)
                    slots[k] = stand_ins[id(v)]
        yield
    finally:
        for slots, k, v in reversed(saved):
            slots[k] = v
        for m, before in had:
            for k in set(vars(m)) - before:
                if isinstance(vars(m)[k], Tensor) and vars(m)[k].device.type == "meta":
                    delattr(m, k)


def trace_shapes(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(input shape, output shape)`` of every leaf module's first call for one sample of ``input_shape``
    (C, *spatial), traced on the meta device (nothing allocated, nothing computed) in the dtype of the model's
    first floating parameter.

    The model's parameters, buffers and tensor attributes are the same objects, with the same values, afterwards
    (:func:`_on_meta`); a failing trace raises :class:`ShapeTraceError` naming the innermost layer that was running.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():  # type: ignore[misc]
            # its first call would make its parameters (on the meta device) and turn the layer into its eager class
            raise ShapeTraceError(
                f"layer '{name}' ({type(m).__name__}) has lazy parameters that are not made yet; the shape trace "
                f"would make them"
            )
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    running: list[str] = []  # the layers whose forward has begun and not ended: the innermost one failed
    handles = []
    for name, m in model.named_modules():
        def enter(mod: nn.Module, args: Any, name: str = name) -> None:
            running.append(name)

        def leave(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            running.pop()
            if next(mod.children(), None) is None and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
                shapes.setdefault(name, (tuple(args[0].shape), tuple(out.shape)))
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    modes = {m: m.training for m in model.modules()}
    model.eval()  # shapes do not depend on the mode; training-mode batch norm with momentum=None reads a counter
    try:
        with _on_meta(model), torch.no_grad():
            model(torch.empty((1, *input_shape), device="meta", dtype=dtype))
    except Exception as e:
        where = running[-1] if running else ""
        layer = f"layer '{where}' ({type(model.get_submodule(where)).__name__})" if where else (
            f"the model's own forward ({type(model).__name__})")
        raise ShapeTraceError(
            f"the shape trace of one sample {tuple(input_shape)} on the meta device failed in {layer}: "
            f"{type(e).__name__}: {str(e)[:300]}"
        ) from e
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.train(mode)
    return shapes


def check_split(model: nn.Module, input_shape: Sequence[int], parts: Sequence[int]) -> None:
    """Raise :class:`PartitionError` (or ``ValueError`` for a split of the wrong number of dimensions) for the first
    layer of ``model`` that cannot run on one sample of ``input_shape`` = (C, *spatial) split ``parts``.  The fixes
    it names come in this order: the same number of ranks per sample split along other dimensions (a split that
    works for every layer), the largest split of the failing dimension that works for this layer, a larger input."""
    k = len(parts)
    if len(input_shape) != 1 + k:
        raise ValueError(
            f"spatial_parts={parts_text(parts)} splits {k} spatial dimension(s), but one sample has shape "
            f"{tuple(input_shape)} (channels and {len(input_shape) - 1} spatial dimension(s)); give one part per "
            f"spatial dimension: {dim_names(len(input_shape) - 1)}"
        )
    shapes = trace_shapes(model, input_shape)
    failure = _first_failure(model, shapes, tuple(parts))
    if failure is None:
        return
    name, module, in_shape, axis, best, reason = failure
    names = dim_names(k)
    suggestion = list(parts)
    suggestion[axis] = best
    same_ranks = [alt for alt in _splits_of(math.prod(parts), k) if alt != tuple(parts)
                  and _first_failure(model, shapes, alt) is None]
    other = (f"split the same {math.prod(parts)} ranks per sample as spatial_parts={list(same_ranks[0])}, which "
             f"every layer takes; or " if same_ranks else "")
    raise PartitionError(
        f"layer '{name}' ({type(module).__name__}) with input {'x'.join(map(str, in_shape[2:]))} "
        f"({' x '.join(names)}) cannot be split {parts_text(parts)}: along {names[axis]} {reason}. Fix: {other}the "
        f"largest split of {names[axis]} that works for this layer is {best} (e.g. spatial_parts={suggestion}); or "
        f"use a larger input"
    )


def _splits_of(ranks: int, k: int) -> list[tuple[int, ...]]:
    """Every ``k``-tuple of parts whose product is ``ranks``, the splits of the last dimensions first (W, then H:
    on CPUs torch's fast convolution path keeps a W split's peak low)."""
    if k == 1:
        return [(ranks,)]
    out = [(q, *rest) for q in range(1, ranks + 1) if ranks % q == 0 for rest in _splits_of(ranks // q, k - 1)]
    return sorted(out)


def _first_failure(model: nn.Module, shapes: dict, parts: tuple[int, ...]) -> tuple | None:
    """The first layer that cannot run split ``parts``: (name, module, input shape, axis, the largest split of
    that axis that works for it, why), or None."""
    k = len(parts)
    for name, (in_shape, out_shape) in shapes.items():
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
            reason = (f"its output of {n_out} rows has fewer rows than the {p} parts" if n_out < p else
                      f"a tile of {n // p} rows is thinner than the halo the layer reads")
            return name, module, in_shape, axis, best, reason
    return None

"""torchmetrics objects under spatial parallelism: every pixel and every sample counted once.

A torchmetrics ``Metric`` keeps states that it synchronises over all ranks (sums, concatenations, extrema).
Under spatial parallelism a value reaches a metric in one of two forms, and each needs its own count:

* a **split activation** (a :class:`~lightning_hpc.spatial.dispatch.SpatialTensor`, e.g. the logits of a
  segmentation network): every rank feeds its own tile, so the metric's per-pixel statistics are summed over the
  tiles by the usual all-rank synchronisation, exactly one process's value (confusion counts, sums, means over
  pixels).  A plain tensor fed together with it that spans the whole split extent (a target) is cut to the same
  tile.  Computing on the tile also avoids gathering the activation for each of the metric's own ops.
* a **replicated value** (a loss, a pooled classifier output, anything after a global reduction): every rank of
  a spatial group holds the same value, so an all-rank sum would count it once per tile (a ``SumMetric`` or an
  unnormalised confusion matrix ``ph * pw`` times too large).  The metric is synchronised over the ranks that
  hold the same tile in every sample group instead (:attr:`HybridLayout.replica_group`), which counts each
  sample group once.

:func:`count_once_per_pixel` wraps the ``update`` of each metric of a module; a metric decides its form at its
first update and a later update in the other form is refused (its states could not be synchronised exactly).
The strategy wraps the metrics of the LightningModule and those held by the Trainer's callbacks (as attributes,
or in lists and dicts of them) when it sets up; a metric created later (e.g. at the first batch) is not seen and
keeps torchmetrics' all-rank sum.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_hpc.spatial.dispatch import SpatialDispatchError, SpatialTensor, _plain, _tile_index
from lightning_hpc.spatial.tiling import HybridLayout

__all__ = ["count_once_per_pixel", "metrics_in"]

_MARK = "_lightning_hpc_spatial_update"


def _is_metric(m: nn.Module) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return False
    return isinstance(m, Metric)  # a MetricCollection is a container of Metrics, not one: its members are found


def _tile_inputs(args: tuple, kwargs: dict[str, Any], ref: SpatialTensor) -> tuple[tuple, dict[str, Any]]:
    def tile(a: Any) -> Any:
        if isinstance(a, SpatialTensor):
            return _plain(a)
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            # a target of the whole sample (N x H x W, N x C x H x W) beside split logits: the same tile of it
            hd, wd = ref._hdim - (ref.dim() - a.dim()), ref._wdim - (ref.dim() - a.dim())
            if (
                0 <= hd < a.dim()
                and 0 <= wd < a.dim()
                and (a.shape[hd], a.shape[wd]) == (ref._gshape[ref._hdim], ref._gshape[ref._wdim])
            ):
                return a[_tile_index(a.shape, hd, wd, ref._grid)]
        return a

    return tuple(tile(a) for a in args), {k: tile(v) for k, v in kwargs.items()}


def metrics_in(holder: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, metric)`` for every torchmetrics ``Metric`` of ``holder``: the modules of an ``nn.Module``, or,
    for any other object (a Lightning ``Callback``), its attributes that are metrics, modules holding metrics,
    or lists / tuples / dicts of them."""
    if isinstance(holder, nn.Module):
        for name, m in holder.named_modules(prefix=prefix):
            if _is_metric(m):
                yield name, m
        return
    for attr, value in vars(holder).items():
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
            else [(None, value)]
        for key, item in items:
            if isinstance(item, nn.Module):
                yield from metrics_in(item, f"{prefix}{attr}" + ("" if key is None else f"[{key!r}]"))


def count_once_per_pixel(holder: Any, layout: HybridLayout, prefix: str = "") -> int:
    """Wrap the ``update`` of every torchmetrics ``Metric`` of ``holder`` (a module, or an object such as a
    callback holding metrics: :func:`metrics_in`; see the module docstring); returns how many were wrapped.
    Idempotent."""
    wrapped = 0
    for name, metric in metrics_in(holder, prefix):
        if getattr(metric, _MARK, None) is not None:
            continue
        update = metric.update
        mode: dict[str, str] = {}

        def on_update(*args: Any, _update=update, _metric=metric, _name=name, _mode=mode, **kwargs: Any) -> Any:
            split = [a for a in (*args, *kwargs.values()) if isinstance(a, SpatialTensor)]
            form = "tile" if split else "replicated"
            if _mode.setdefault("form", form) != form:
                raise SpatialDispatchError(
                    f"spatial: metric '{_name}' ({type(_metric).__name__}) was updated with a "
                    f"{'split activation' if _mode['form'] == 'tile' else 'replicated value'} before and with a "
                    f"{'split activation' if form == 'tile' else 'replicated value'} now; its states cannot be "
                    f"synchronised exactly for both. Use one metric object per kind of input"
                )
            if split:
                args, kwargs = _tile_inputs(args, kwargs, split[0])
            elif layout.replica_group is not None:
                _metric.process_group = layout.replica_group
            return _update(*args, **kwargs)

        functools.update_wrapper(on_update, update)
        metric.update = on_update  # type: ignore[method-assign]
        setattr(metric, _MARK, on_update)
        wrapped += 1
    return wrapped

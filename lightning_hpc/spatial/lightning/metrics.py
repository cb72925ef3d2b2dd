"""torchmetrics objects under spatial parallelism: every pixel and every sample counted once.

A torchmetrics ``Metric`` keeps states that it synchronises over all ranks (sums, concatenations, extrema).
Under spatial parallelism a value reaches a metric in one of two forms, and each needs its own count:

* a **split activation** (a :class:`~lightning_hpc.spatial.dispatch.SpatialTensor`, e.g. the logits of a
  segmentation network), to a metric whose states are sums over pixels (:func:`_sums_over_pixels`: confusion
  counts, sums, means over pixels): every rank feeds its own tile, so those states are summed over the tiles by
  the usual all-rank synchronisation, exactly one process's value.  A plain tensor fed together with it that
  spans the whole split extent (a target) is cut to the same tile.  Computing on the tile also avoids gathering
  the activation for each of the metric's own ops.  A tile cut out by hand with
  :func:`~lightning_hpc.spatial.dispatch.local_tile` counts the same way.  To any other metric (per-sample
  scores such as MeanIoU or DiceScore, windowed ones such as SSIM: the tiles' states cannot be combined), the
  split inputs are gathered and the metric counts as fed a replicated value (next point), so it is computed
  on the whole samples; fed a ``local_tile``, such a metric is refused.
* a **replicated value** (a loss, a pooled classifier output, anything after a global reduction): every rank of
  a spatial group holds the same value, so an all-rank sum would count it once per tile (a ``SumMetric`` or an
  unnormalised confusion matrix ``ph * pw`` times too large).  The metric is synchronised over the ranks that
  hold the same tile in every sample group instead (:attr:`HybridLayout.replica_group`), which counts each
  sample group once.

A metric records its form at its first update (a later update in the other form is refused: its states could
not be synchronised exactly) and the form picks the group when the metric synchronises.

Which metrics: all of them, whenever and wherever they are created.  While a spatial strategy runs
(:func:`activate` ... :func:`deactivate`) two class-level hooks on ``torchmetrics.Metric`` are installed:

* ``Metric._wrap_update``, which torchmetrics itself calls when it builds a metric (``__init__``) or restores one
  (``__setstate__``: ``clone()``, ``deepcopy``, unpickling): every metric made during the run, lazily at the
  first batch, in ``on_validation_epoch_start``, by a callback, inside a ``MetricCollection`` or a wrapper,
  gets the counting ``update`` from birth, wherever it is kept;
* ``Metric.sync``, the single entry of every synchronisation (``compute()``, ``dist_sync_on_step``, a manual
  ``sync()``): it picks the group from the recorded form, and refuses a metric that was updated without the
  counting ``update`` (made before the run and kept where :func:`count_once_per_pixel` did not look, e.g. a
  module-level global), since its form is unknown and an all-rank sum could count it once per tile.

Metrics that exist before the run are wrapped by :func:`count_once_per_pixel` (the strategy runs it on the
LightningModule and the Trainer's callbacks at setup and again when each loop starts).  A hook at the class
level is chosen over re-scanning alone because a scan only sees metrics held where it looks and only after it
runs (a metric made and updated within one step would be missed), and over intercepting the synchronisation
alone because by then a split input's target could no longer be cut to the tile.  Metrics without states of their
own (``CompositionalMetric``, the wrappers) forward to their members, which count for themselves.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_hpc._compat import replace_metric_hooks, stat_scores_base
from lightning_hpc.spatial.dispatch import SpatialDispatchError, SpatialTensor, _plain, _tile_index
from lightning_hpc.spatial.dispatch.flat import FlatSpatialTensor
from lightning_hpc.spatial.dispatch.tensor import TILE_MARK
from lightning_hpc.spatial.layout.tiling import HybridLayout

__all__ = ["activate", "count_once_per_pixel", "deactivate", "metrics_in"]

_MARK = "_lightning_hpc_spatial_update"  # the counting update a metric was given (a clone carries a stale one)
_FORM = "_lightning_hpc_spatial_form"  # "tile" or "replicated", recorded at the first update
_NAME = "_lightning_hpc_spatial_name"  # for messages
_WARNED = "_lightning_hpc_spatial_gather_warned"  # the one-time gather warning was given

_ACTIVE: list[HybridLayout] = []  # layouts of the running strategies (one in practice); the last one counts
_ORIGINAL: dict[str, Any] = {}  # torchmetrics' own Metric._wrap_update / Metric.sync while the hooks are in


def _metric_class() -> type | None:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return None
    return Metric


def _is_metric(m: Any) -> bool:
    metric = _metric_class()
    # a MetricCollection is a container of Metrics, not one: its members are found
    return metric is not None and isinstance(m, metric)


def _tile_inputs(args: tuple, kwargs: dict[str, Any], ref: SpatialTensor) -> tuple[tuple, dict[str, Any]]:
    def tile(a: Any) -> Any:
        if isinstance(a, SpatialTensor):
            return _plain(a)
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            # a target of the whole sample (N x H x W, N x C x H x W) beside split logits: the same tile of it
            sdims = tuple(d - (ref.dim() - a.dim()) for d in ref._sdims)
            if all(0 <= d < a.dim() for d in sdims) and \
                    [a.shape[d] for d in sdims] == [ref._gshape[d] for d in ref._sdims]:
                return a[_tile_index(a.shape, sdims, ref._grid)]
        return a

    return tuple(tile(a) for a in args), {k: tile(v) for k, v in kwargs.items()}


def _sums_over_pixels(metric: Any) -> bool:
    """Whether ``metric``'s states are sums (or extrema) over pixels of per-pixel terms, so the states of the tiles,
    summed by the all-rank synchronisation, are the whole samples' states: counts of the stat-score family over
    all pixels (``multidim_average="global"``: accuracy, precision, recall, F-scores, specificity), confusion
    matrices (Jaccard), precision-recall curves (AUROC, average precision: order-free lists or binned counts),
    sum / mean / max / min aggregation, mean squared and absolute error, PSNR over all pixels.  Anything else
    (per-sample scores such as ``segmentation.MeanIoU`` or ``DiceScore``, windowed ones such as SSIM, per-sample
    reductions, metrics unknown here) is not taken to be one."""
    try:
        from torchmetrics import aggregation, classification, image, regression
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return False
    if isinstance(metric, stat_scores_base()):
        return getattr(metric, "multidim_average", "global") == "global"
    sums = (
        classification.BinaryConfusionMatrix, classification.MulticlassConfusionMatrix,
        classification.MultilabelConfusionMatrix, classification.BinaryPrecisionRecallCurve,
        classification.MulticlassPrecisionRecallCurve, classification.MultilabelPrecisionRecallCurve,
        aggregation.SumMetric, aggregation.MeanMetric, aggregation.MaxMetric, aggregation.MinMetric,
        regression.MeanSquaredError, regression.MeanAbsoluteError,
    )
    if isinstance(metric, sums):
        return True
    if isinstance(metric, image.PeakSignalNoiseRatio):
        return getattr(metric, "dim", None) is None  # a per-sample PSNR (dim set) is not a sum over pixels
    return False


def _whole_inputs(metric: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The whole samples for a metric that is not a sum over pixels: every split input is gathered (every rank of
    the spatial group updates its metrics in the same order, so the all-gathers pair up), whole inputs stay as
    they are, and the metric counts as fed replicated values.  Warned once per metric with the bytes."""
    nbytes = sum(a.element_size() * a.numel() for a in (*args, *kwargs.values()) if isinstance(a, SpatialTensor))
    if not metric.__dict__.get(_WARNED):
        metric.__dict__[_WARNED] = True
        warnings.warn(
            f"spatial: metric '{_name(metric)}' ({type(metric).__name__}) is not a sum over pixels (per-sample or "
            f"windowed states), so tiles cannot be combined: its split inputs are gathered ({nbytes} bytes per rank "
            f"per update) and it is computed on the whole samples, exactly as one process does",
            stacklevel=3,
        )

    def whole(a: Any) -> Any:
        if isinstance(a, SpatialTensor):
            with torch.no_grad():
                return a.full()
        return a

    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def _containers(value: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    return iter([(None, value)])


def metrics_in(holder: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, metric)`` for every torchmetrics ``Metric`` of ``holder``: the modules of an ``nn.Module`` and
    the metrics its modules keep in plain lists / tuples / dicts (not registered as submodules), or, for any other
    object (a Lightning ``Callback``), its attributes that are metrics, modules holding metrics, or lists /
    tuples / dicts of them."""
    if isinstance(holder, nn.Module):
        for name, m in holder.named_modules(prefix=prefix):
            if _is_metric(m):
                yield name, m
            for attr, value in vars(m).items():
                if isinstance(value, (list, tuple, dict)) and not attr.startswith("_"):
                    for key, item in _containers(value):
                        if _is_metric(item):
                            yield f"{name}.{attr}[{key!r}]" if name else f"{attr}[{key!r}]", item
        return
    for attr, value in vars(holder).items():
        for key, item in _containers(value):
            if isinstance(item, nn.Module):
                yield from metrics_in(item, f"{prefix}{attr}" + ("" if key is None else f"[{key!r}]"))


def _counting_update(metric: Any, update: Callable[..., Any]) -> Callable[..., Any]:
    """``update`` of ``metric`` counting each pixel and sample once while a spatial strategy runs (module
    docstring); outside one, or for a metric without states of its own, ``update`` itself."""

    def on_update(*args: Any, **kwargs: Any) -> Any:
        layout = _ACTIVE[-1] if _ACTIVE else None
        if layout is None or not metric._defaults:  # no states: its members count for themselves
            return update(*args, **kwargs)
        if any(isinstance(a, FlatSpatialTensor) for a in (*args, *kwargs.values())):
            # a view merging split dimensions: its tile is not a block, so a whole target beside it could not be
            # cut to it; the metric gets it whole (as one process), as before such views were tiled
            args = tuple(a.full() if isinstance(a, FlatSpatialTensor) else a for a in args)
            kwargs = {k: v.full() if isinstance(v, FlatSpatialTensor) else v for k, v in kwargs.items()}
        inputs = (*args, *kwargs.values())
        split = [a for a in inputs if isinstance(a, SpatialTensor)]
        # a tile cut out by hand (dispatch.local_tile) is a tile too; one of its operands is enough to say so
        marked = any(getattr(a, TILE_MARK, False) for a in inputs)
        additive = (split or marked) and _sums_over_pixels(metric)
        if marked and not additive:
            raise SpatialDispatchError(
                f"spatial: metric '{_name(metric)}' ({type(metric).__name__}) was fed a tile cut out with local_tile, "
                f"but its states are not sums over pixels (per-sample scores, windows across tiles), so tiles cannot "
                f"be combined exactly. Feed it the split tensor itself: it is then computed on the whole samples"
            )
        form = "tile" if additive else "replicated"
        before = metric.__dict__.setdefault(_FORM, form)
        if before != form:
            kinds = {"tile": "split activation", "replicated": "replicated value"}
            raise SpatialDispatchError(
                f"spatial: metric '{_name(metric)}' ({type(metric).__name__}) was updated with a {kinds[before]} "
                f"before and with a {kinds[form]} now; its states cannot be synchronised exactly for both. Use one "
                f"metric object per kind of input"
            )
        if split and additive:
            args, kwargs = _tile_inputs(args, kwargs, split[0])
        elif split:
            args, kwargs = _whole_inputs(metric, args, kwargs)
        return update(*args, **kwargs)

    functools.update_wrapper(on_update, update)
    metric.__dict__[_MARK] = on_update
    return on_update


def _name(metric: Any) -> str:
    return metric.__dict__.get(_NAME) or f"{type(metric).__name__} made during the run"


def count_once_per_pixel(holder: Any, layout: HybridLayout | None = None, prefix: str = "") -> int:
    """Give the counting ``update`` to every torchmetrics ``Metric`` of ``holder`` (a module, or an object such
    as a callback holding metrics: :func:`metrics_in`) that does not have it yet; returns how many got it.  The
    counting is in force while a layout is active (:func:`activate`; ``layout`` activates one for plain-torch
    use).  Idempotent."""
    if layout is not None and not any(active is layout for active in _ACTIVE):
        activate(layout)
    wrapped = 0
    for name, metric in metrics_in(holder, prefix):
        metric.__dict__.setdefault(_NAME, name)
        if metric.__dict__.get(_MARK) is not None and metric.__dict__.get(_MARK) is metric.__dict__.get("update"):
            continue  # already counting (a clone carries its original's stale mark and is wrapped again)
        metric.update = _counting_update(metric, metric.update)
        wrapped += 1
    return wrapped


def _wrap_update(self: Any, update: Callable[..., Any]) -> Callable[..., Any]:
    """``Metric._wrap_update`` while a spatial strategy runs: torchmetrics' wrapped update, counting."""
    return _counting_update(self, _ORIGINAL["_wrap_update"](self, update))


def _sync(self: Any, dist_sync_fn: Callable | None = None, process_group: Any = None, should_sync: bool = True,
          distributed_available: Callable | None = None) -> None:
    """``Metric.sync`` while a spatial strategy runs: a metric fed replicated values synchronises over the ranks
    holding the same tile of every sample group; one fed split activations over all ranks (its tiles summed); one
    updated without the counting ``update`` is refused (its form is unknown)."""
    layout = _ACTIVE[-1] if _ACTIVE else None
    if layout is not None and should_sync and process_group is None and self._defaults:
        form = self.__dict__.get(_FORM)
        if form == "replicated":
            process_group = layout.replica_group
        elif form is None and self._update_count > 0:
            raise SpatialDispatchError(
                f"spatial: metric {type(self).__name__} was updated during the run without spatial counting (it "
                f"was made before the strategy's setup and is kept neither by the LightningModule nor by a "
                f"Trainer callback), so whether it holds tiles or replicated values is unknown and torchmetrics' "
                f"all-rank sum could count a value once per tile. Keep it on the LightningModule or a callback, "
                f"create it in a hook (setup, on_fit_start, the first batch), or call "
                f"lightning_hpc.spatial.lightning.metrics.count_once_per_pixel on its holder"
            )
    return _ORIGINAL["sync"](self, dist_sync_fn, process_group, should_sync, distributed_available)


def activate(layout: HybridLayout) -> None:
    """Count metrics for ``layout`` until :func:`deactivate`: installs the class-level hooks on the first call."""
    metric = _metric_class()
    if metric is None:
        return
    if not _ORIGINAL:
        _ORIGINAL.update(replace_metric_hooks(_wrap_update, _sync))
    _ACTIVE.append(layout)


def deactivate(layout: HybridLayout) -> None:
    """End :func:`activate` for ``layout``; the hooks go when no layout is active (metrics made meanwhile keep
    their counting ``update``, which then passes through)."""
    for k, active in enumerate(_ACTIVE):
        if active is layout:
            del _ACTIVE[k]
            break
    metric = _metric_class()
    if not _ACTIVE and _ORIGINAL and metric is not None:
        replace_metric_hooks(_ORIGINAL.pop("_wrap_update"), _ORIGINAL.pop("sync"))

"""The planner's entry point (Dryden et al., IPDPS 2019, section V): :func:`plan_for_model` traces the model
(:mod:`.graph`), costs every candidate distribution of every stage (:mod:`.cost`, sections V-A and V-B), searches
the cheapest assignment (:mod:`.search`, section V-C), predicts the time per mini-batch (:mod:`.simulate`,
section V-B) and returns it as a :class:`Plan`.  Plain torch: no Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer
from lightning_hpc.perfmodel.sync import SyncCost
from lightning_hpc.spatial.planner.cost import CostModel, StageCost
from lightning_hpc.spatial.planner.graph import Distribution, build_stages, trace_layers
from lightning_hpc.spatial.planner.search import NoSingleSplitError, _assign, candidate_distributions
from lightning_hpc.spatial.planner.simulate import _optimizer_time, _simulate

__all__ = ["Plan", "plan_for_model"]


@dataclass
class Plan:
    """A parallel execution strategy: a distribution per layer and the predicted time per mini-batch."""

    world_size: int
    batch_size: int
    input_shape: tuple[int, ...]
    distributions: dict[str, Distribution]  # every traced layer, in execution order
    stage_costs: dict[str, StageCost]
    shuffle_time: float
    compute_time: float
    halo_time: float
    allreduce_time: float  # total allreduce time (partly hidden behind backward)
    exposed_allreduce_time: float
    optimizer_time: float
    predicted_step_time: float
    model: AlphaBeta
    method: str  # "shortest-path", "longest-path-first" or "uniform"
    sync_points: int = 0  # synchronisation points per step (halo exchanges, collectives, shuffles, allreduces)
    sync_time: float = 0.0  # loaded synchronisation cost beyond alpha-beta of the non-gradient ones (s)
    sync: SyncCost | None = None  # the measured loaded synchronisation costs used (None: alpha-beta only)
    #: the module class of each layer that is a module (the others are functions such as ``add`` or ``cat``)
    layer_types: dict[str, str] | None = None
    #: each traced layer's output shape for the whole mini-batch (() for a value that is not a tensor)
    layer_shapes: dict[str, tuple[int, ...]] | None = None
    #: bytes of the model's trainable parameters (every rank holds them whole)
    parameter_bytes: int = 0

    @property
    def spatial_parts(self) -> tuple[int, ...]:
        """The input layer's parts of each spatial dimension (``(ph, pw)`` for images, ``(pd, ph, pw)`` for
        volumes): the tile each rank of a spatial group reads."""
        return next(iter(self.distributions.values())).parts(len(self.input_shape) - 1)

    @property
    def sample_groups(self) -> int:
        return next(iter(self.distributions.values())).n

    def memory_per_rank(self, dtype_bytes: int = 4) -> dict[str, int] | None:
        """The memory one rank holds under the plan, as the planner models it (None without the layers' shapes):

        * ``activations``: the output of every traced layer (modules and functions such as ``add`` or ``cat``) at
          the shape of this rank's part of it under the layer's distribution (``ceil(N / n)`` samples, each split
          spatial extent ``ceil(extent / parts)``), ``dtype_bytes`` per element: what autograd can hold for
          backward at the end of the forward.  Views and in-place layers are counted as new tensors (an upper
          bound); halo buffers, kernel workspaces and the input batch are not counted;
        * ``activations_one_process``: the same for one process holding the whole mini-batch;
        * ``parameters_and_gradients``: the trainable parameters and their gradients, whole on every rank
          (optimizer state not counted)."""
        if self.layer_shapes is None:
            return None

        def held(shape: tuple[int, ...], d: Distribution) -> int:
            if len(shape) < 2:
                return math.prod(shape) if shape else 0
            spatial = shape[2:]
            parts = d.parts(len(spatial)) if len(spatial) <= 3 else (1,) * len(spatial)
            return -(-shape[0] // d.n) * shape[1] * math.prod(-(-e // p) for e, p in zip(spatial, parts))

        whole = Distribution(1, 1, 1)
        return {
            "activations": dtype_bytes * sum(held(s, self.distributions[k]) for k, s in self.layer_shapes.items()),
            "activations_one_process": dtype_bytes * sum(held(s, whole) for s in self.layer_shapes.values()),
            "parameters_and_gradients": 2 * self.parameter_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "method": self.method,
            "spatial_parts": list(self.spatial_parts),
            "sample_groups": self.sample_groups,
            "predicted_step_time_s": self.predicted_step_time,
            "compute_time_s": self.compute_time,
            "halo_time_s": self.halo_time,
            "shuffle_time_s": self.shuffle_time,
            "allreduce_time_s": self.allreduce_time,
            "exposed_allreduce_time_s": self.exposed_allreduce_time,
            "optimizer_time_s": self.optimizer_time,
            "sync_points": self.sync_points,
            "sync_time_s": self.sync_time,
            "memory_per_rank_bytes": self.memory_per_rank(),
            "alpha_beta": self.model.to_dict(),
            "loaded_sync": None if self.sync is None else self.sync.to_dict(),
            "layers": [
                {"name": name, "distribution": asdict(d), "label": str(d)} for name, d in self.distributions.items()
            ],
            "stages": {
                name: {k: v for k, v in asdict(c).items() if k not in ("allreduces", "backward")} | {"total": c.total}
                for name, c in self.stage_costs.items()
            },
        }

    def table(self) -> str:
        """The plan as text: the split (one for the whole model when planned ``uniform``, as the strategy runs
        it), then each layer of the model (the modules, by the names ``named_modules`` gives them) with its
        distribution and the cost of the stage it heads."""
        ndim = len(self.input_shape) - 1
        names = {1: "L", 2: "H x W", 3: "D x H x W"}[ndim]
        split = " x ".join(str(p) for p in self.spatial_parts)
        lines = [
            f"plan for {self.world_size} processes, mini-batch {self.batch_size}, input {list(self.input_shape)}"
            f" ({self.method})",
            f"split: {split} ({names}) tiles per sample x {self.sample_groups} sample group(s)"
            + (" for every layer" if self.method == "uniform" else " at the input (layers below differ)"),
            f"{'layer':32s} {'type':16s} {'distribution':30s} {'stage cost (ms)':>16s}",
        ]
        for name, dist in self.distributions.items():
            kind = (self.layer_types or {}).get(name)
            if self.layer_types is not None and kind is None:
                continue  # a function of the traced graph (add, cat, getattr ...): not a layer of the model
            cost = self.stage_costs.get(name)
            lines.append(f"{name:32s} {kind or '':16s} {dist.label(ndim):30s} "
                         f"{'' if cost is None else f'{1e3 * cost.total:16.2f}'}")
        lines += [
            f"spatial parts = {self.spatial_parts}, sample groups = {self.sample_groups}",
            f"compute {1e3 * self.compute_time:.2f} ms + halo {1e3 * self.halo_time:.2f} ms"
            f" + shuffle {1e3 * self.shuffle_time:.2f} ms"
            f" + loaded sync waits {1e3 * self.sync_time:.2f} ms ({self.sync_points} sync points)"
            f" + exposed allreduce {1e3 * self.exposed_allreduce_time:.2f} ms (of {1e3 * self.allreduce_time:.2f} ms)"
            f" + optimizer {1e3 * self.optimizer_time:.2f} ms",
            f"predicted time per mini-batch: {1e3 * self.predicted_step_time:.2f} ms",
        ]
        mem = self.memory_per_rank()
        if mem is not None:
            mib, one = 2.0**-20, mem["activations_one_process"]
            lines.append(
                f"predicted memory per rank: activations {mib * mem['activations']:.1f} MiB (one process: "
                f"{mib * one:.1f} MiB, {mem['activations'] / max(one, 1):.2f}x) + parameters and gradients "
                f"{mib * mem['parameters_and_gradients']:.1f} MiB; counts every traced layer's output at the rank's "
                f"tile in float32 (what backward can hold), not halo buffers, kernel workspaces, optimizer state or "
                f"the input batch")
        return "\n".join(lines)


def plan_for_model(
    model: nn.Module,
    input_shape: Sequence[int],
    world_size: int,
    batch_size: int = 1,
    alpha_beta: AlphaBeta | None = None,
    timer: LayerTimer | None = None,
    uniform: bool = False,
    restrict: Callable[[Distribution], bool] | None = None,
    overlap_halo: bool = False,
    aggregate_bn: bool = True,
    compute_scale: float = 1.0,
    optimizer: str = "sgd",
    device: str | torch.device = "cpu",
    gradient_reduction: str = "per-layer",
    sync: SyncCost | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Choose a distribution for every layer of ``model`` on ``world_size`` processes at mini-batch
    ``batch_size`` (``input_shape`` = (C, H, W) of one image, (C, D, H, W) of a volume or (C, L) of a signal) and
    predict the time per mini-batch.

    ``alpha_beta``: the interconnect (default: :func:`lightning_hpc.perfmodel.calibrate_local` on 2 local
    processes, cached).  ``uniform=True`` keeps one distribution for all layers (the setting of the paper's
    experiments, and what a strategy with a single ``spatial_parts`` runs).  ``restrict`` filters candidates
    (e.g. ``lambda d: d.h == d.w == 1`` for pure sample parallelism).  ``compute_scale`` multiplies measured
    compute, e.g. ``processes / cores`` when ranks share too few cores.  ``gradient_reduction``: see
    :data:`.cost.GRADIENT_REDUCTIONS` (the paper's per-layer overlapped allreduces, one fused allreduce, or DDP's
    buckets).  ``sync``: the measured cost of a synchronisation between busy ranks
    (:func:`lightning_hpc.perfmodel.sync.calibrate_sync` on ``world_size`` processes); every halo exchange,
    batch-norm collective, shuffle and gradient allreduce of the plan is then charged its alpha-beta cost plus
    that measured extra, and only the measured share of an allreduce is hidden behind backward.  Default None:
    the plain alpha-beta model of section V-A (right for ranks with cores to spare).  ``progress`` receives a line
    before each stage's candidates are costed (layer times are measured then, unless cached).

    Called inside a distributed job, rank 0 plans (alpha-beta calibrated on the job's process group) and
    broadcasts the plan, so every rank uses the same one.
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    if not 2 <= len(input_shape) <= 4:
        raise ValueError(
            f"input_shape must be (C, L), (C, H, W) or (C, D, H, W) of one sample, got {list(input_shape)}")
    import torch.distributed as dist

    # inside a job (a strategy planning at setup) alpha-beta is calibrated on the job's own process group
    in_job = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if alpha_beta is None:
        from lightning_hpc.perfmodel import calibrate, calibrate_local

        alpha_beta = calibrate() if in_job else calibrate_local(2)

    def plan() -> Plan:
        assert alpha_beta is not None
        layers = trace_layers(model, (batch_size, *input_shape))
        stages = build_stages(layers)
        costs = CostModel(
            alpha_beta, world_size, batch_size, timer, overlap_halo, aggregate_bn, compute_scale,
            device=device, gradient_reduction=gradient_reduction, sync=sync,
        )
        cands = {}
        for s in stages:
            options = candidate_distributions(s, world_size, batch_size, ndim=len(input_shape) - 1)
            if restrict is not None:
                kept = [d for d in options if restrict(d)]
                if not kept:
                    raise ValueError(
                        f"no candidate distribution of layer {s.name} (input {list(s.head.in_shape)}) passes the "
                        f"restriction; candidates: {[str(d) for d in options]}"
                    )
                options = kept
            cands[s.name] = options
        if progress is not None:  # cost what the search will cost, stage by stage, saying so (measured times
            # are cached: the search then reads them)
            common = set.intersection(*(set(c) for c in cands.values())) if uniform and cands else None
            if common is not None and not common:
                raise NoSingleSplitError("no single distribution fits every layer; plan per layer (uniform=False)")
            total = sum(len([d for d in cands[s.name] if common is None or d in common]) for s in stages)
            progress(f"costing {len(stages)} stages under {total} (stage, distribution) pairs: each layer's forward "
                     f"and backward at its tile's shape is timed on this machine unless cached (for large volumes on "
                     f"a CPU, minutes the first time; seconds from the cache)")
            for i, s in enumerate(stages):
                todo = [d for d in cands[s.name] if common is None or d in common]
                progress(f"stage {i + 1}/{len(stages)}: {s.name} ({len(todo)} distributions)")
                for d in todo:
                    costs.stage_cost(s, d)
        assignment, method = _assign(stages, cands, costs, uniform)
        sim = _simulate(stages, assignment, costs)
        opt = compute_scale * _optimizer_time(model, optimizer)
        stage_of = {layer.name: s.name for s in stages for layer in s.layers}
        return Plan(
            world_size=world_size,
            batch_size=batch_size,
            input_shape=tuple(input_shape),
            distributions={layer.name: assignment[stage_of[layer.name]] for layer in layers},
            stage_costs={s.name: costs.stage_cost(s, assignment[s.name]) for s in stages},
            shuffle_time=sim["shuffle"],
            compute_time=sim["compute"],
            halo_time=sim["halo"],
            allreduce_time=sim["allreduce"],
            exposed_allreduce_time=sim["exposed_allreduce"],
            optimizer_time=opt,
            predicted_step_time=sim["end"] + opt,
            model=alpha_beta,
            method=method,
            sync_points=int(sim["sync_points"]),
            sync_time=sim["sync_time"],
            sync=costs.sync,
            layer_types={layer.name: type(layer.module).__name__ for layer in layers if layer.module is not None},
            layer_shapes={layer.name: layer.out_shape for layer in layers},
            parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        )

    if not in_job:
        return plan()
    # measured times differ between ranks, so rank 0 plans and every rank gets the same plan (or error)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = plan()
        except Exception as e:  # every rank must leave the broadcast, then all raise the same error
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]

"""Cost model of the planner (Dryden et al., IPDPS 2019, sections V-A and V-B).

* V-A, per-layer cost under a distribution ``D = (n, [d,] h, w)``: measured local compute (forward + backward at
  the tile's shape, :class:`lightning_hpc.perfmodel.LayerTimer`), halo exchanges (the paper's
  ``2 SR(O n C w) + 2 SR(O n C h) + 4 SR(O^2 n C)`` for an interior tile of an image; here one ``SR`` per block
  the busiest tile receives, each block's size from the layer's own windows
  (:mod:`lightning_hpc.spatial.dispatch.windows`): faces, edges and corners in 3-D) in forward and again in
  backward, and the weight-gradient allreduce ``AR(P, |w|)``, with alpha-beta costs from
  :mod:`lightning_hpc.perfmodel.alphabeta`.
* V-B, whole network: every layer is measured (not only convolutions: on CPUs batch norm and ReLU are not free),
  spatially aggregated batch norm adds two small allreduces over the spatial group, and a change of distribution
  between adjacent layers costs an all-to-all shuffle forward and backward.

With a loaded-sync calibration (:mod:`lightning_hpc.perfmodel.sync`) every synchronisation point is also charged
its measured cost between busy ranks.  Plain torch: no Lightning import.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, alphabeta
from lightning_hpc.perfmodel.sync import SyncCost
from lightning_hpc.spatial.dispatch.windows import CONVOLUTIONS, halo_elements
from lightning_hpc.spatial.kernels import tile_convolution_applies
from lightning_hpc.spatial.planner.graph import Distribution, LayerInfo, Stage

__all__ = [
    "GRADIENT_REDUCTIONS",
    "DDP_FIRST_BUCKET_BYTES",
    "DDP_BUCKET_BYTES",
    "StageCost",
    "CostModel",
]


#: "per-layer": one allreduce per parametrised layer as soon as its backward is done (section V-B, greedy
#: overlap); "single": all gradients flattened into one allreduce after backward (no overlap); "bucketed": what
#: torch DDP does, gradients packed in backward order into buckets (the first of DDP_FIRST_BUCKET_BYTES, then
#: DDP_BUCKET_BYTES), each allreduced as soon as it is full, overlapping the rest of backward.
GRADIENT_REDUCTIONS = ("per-layer", "single", "bucketed")
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)


@dataclass
class StageCost:
    compute: float  # forward + backward of every layer at the tile's shape (s)
    halo: float  # halo exchanges, forward and backward (s)
    bn_stats: float  # spatially aggregated batch-norm statistics (s)
    allreduce: float  # gradient allreduce of the stage's parameters, not overlapped (s)
    allreduces: list[tuple[str, float]] = field(default_factory=list)  # per parametrised layer
    backward: list[tuple[str, float]] = field(default_factory=list)  # per layer backward compute (s)
    copies: float = 0.0  # building the tile + halo box: once in forward, once in backward (s)
    sync_points: int = 0  # halo exchanges and small collectives of the stage, forward and backward
    sync_wait: float = 0.0  # their measured cost under load beyond alpha-beta (perfmodel.sync; 0 without it)

    @property
    def total(self) -> float:
        """``Cost_D(l) = FP + BPx + BPw + BPa`` (section V-A), plus the halo box copies of this implementation and
        the loaded synchronisation cost of every synchronisation point (:mod:`lightning_hpc.perfmodel.sync`)."""
        return self.local + self.allreduce

    @property
    def local(self) -> float:
        return self.compute + self.halo + self.copies + self.bn_stats + self.sync_wait


class CostModel:
    """Costs of stages under distributions and of shuffles between them (sections V-A and V-B)."""

    def __init__(
        self,
        model: AlphaBeta,
        world_size: int,
        batch_size: int,
        timer: LayerTimer | None = None,
        overlap_halo: bool = False,
        aggregate_bn: bool = True,
        compute_scale: float = 1.0,
        dtype_bytes: int = 4,
        device: str | torch.device = "cpu",
        gradient_reduction: str = "per-layer",
        sync: SyncCost | None = None,
    ) -> None:
        if gradient_reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, got {gradient_reduction!r}")
        if sync is not None and world_size > 1 and sync.world_size != world_size:
            raise ValueError(
                f"the loaded sync calibration was measured on {sync.world_size} processes but the plan is for "
                f"{world_size}; measure it with perfmodel.sync.calibrate_sync({world_size})"
            )
        self.gradient_reduction = gradient_reduction
        #: loaded synchronisation costs (None: the plain alpha-beta model of section V-A)
        self.sync = sync if sync is not None and world_size > 1 else None
        self.m, self.p, self.batch = model, world_size, batch_size
        self.timer = timer or LayerTimer()
        self.overlap_halo, self.aggregate_bn = overlap_halo, aggregate_bn
        self.compute_scale, self.bytes, self.device = compute_scale, dtype_bytes, device
        self._cache: dict[tuple[str, Distribution], StageCost] = {}

    def local_shape(self, shape: tuple[int, ...], d: Distribution) -> tuple[int, ...]:
        n = math.ceil(shape[0] / d.n)
        k = len(shape) - 2
        if 1 <= k <= 3:
            return (n, shape[1], *(math.ceil(e / p) for e, p in zip(shape[2:], d.parts(k))))
        return (n, *shape[1:])

    def _halo(self, layer: LayerInfo, d: Distribution) -> float:
        """One halo exchange (section V-A): a send/recv per block the busiest tile receives
        (:mod:`lightning_hpc.spatial.dispatch.windows`)."""
        windows, k = layer.windows, layer.spatial_ndim
        if windows is None or not 1 <= k <= 3 or d.spatial_size == 1:
            return 0.0
        n, c = self.local_shape(layer.in_shape, d)[:2]
        blocks = halo_elements(windows, layer.in_shape[2:], d.parts(k))
        return sum(alphabeta.send_recv(e * n * c * self.bytes, self.m) for e in blocks)

    def sync_wait(self, kind: str, group: int | None = None) -> float:
        """Measured cost of one synchronisation point of ``kind`` under load beyond its alpha-beta cost (0 without
        a calibration); see :meth:`lightning_hpc.perfmodel.sync.SyncCost.wait`."""
        return 0.0 if self.sync is None else self.sync.wait(kind, self.m, group)

    def gradient_allreduce(self, nbytes: float, p: int | None = None) -> float:
        """One gradient allreduce: the alpha-beta cost, or the measured cost of an allreduce that size between
        busy ranks when that is larger."""
        ab = alphabeta.allreduce(nbytes, p or self.p, self.m)
        if self.sync is None or nbytes <= 0:
            return ab
        return max(ab, self.sync.gradient_allreduce(nbytes))

    def stage_cost(self, stage: Stage, d: Distribution) -> StageCost:
        key = (stage.name, d)
        if key in self._cache:
            return self._cache[key]
        compute = halo = bn = copies = wait = 0.0
        syncs = 0
        allreduces: list[tuple[str, float]] = []
        backward: list[tuple[str, float]] = []
        spatial = d.spatial_size
        for layer in stage.layers:
            if layer.module is not None and layer.in_shape:
                shape = self.local_shape(layer.in_shape, d)
                module = _fresh(layer.module)
                if isinstance(module, _BATCH_NORMS) and math.prod(shape) // shape[1] == 1:
                    module.eval()  # one value per channel on this tile: the statistics come from the group
                t = self.timer.measure(module, shape, device=self.device)
                fwd, bwd = self.compute_scale * t["forward"], self.compute_scale * t["backward"]
            else:
                fwd = bwd = 0.0  # element-wise functions (residual adds, flatten) are treated as free
            x = self._halo(layer, d)
            # the network's input needs no gradient, so its layer exchanges no halo in backward
            x_bwd = x if layer.parents else 0.0
            if x > 0 and layer.module is not None and not (
                type(layer.module) in CONVOLUTIONS  # (x > 0: it has windows)
                and tile_convolution_applies(layer.in_shape[2:], d.parts(len(layer.in_shape) - 2), layer.windows or ())
            ):
                # the spatial layer copies its tile into a box with the halo (forward) and rebuilds it (backward);
                # a convolution on stride-aligned tiles convolves the tile in place and copies only edge rows
                copies += 2 * self.compute_scale * self.timer.measure(
                    _TileCopy(), self.local_shape(layer.in_shape, d), device=self.device
                )["forward"]
            if x > 0:  # every exchange is a synchronisation point with the neighbours, overlapped or not
                n_ex = 2 if x_bwd > 0 else 1
                syncs += n_ex
                wait += n_ex * self.sync_wait("sendrecv")
            if self.overlap_halo:  # interior computation hides the exchange (section IV-A)
                compute += max(fwd, x) + max(bwd, x_bwd)
            else:
                compute += fwd + bwd
                halo += x + x_bwd
            backward.append((layer.name, bwd))
            if isinstance(layer.module, _BATCH_NORMS) and self.aggregate_bn and spatial > 1:
                # sum and sum of squares forward, their gradients backward, over the spatial group
                bn += 2 * alphabeta.allreduce(2 * layer.module.num_features * self.bytes, spatial, self.m)
                syncs += 2  # this implementation: an all-gather of (mean, var, count) forward, an allreduce backward
                wait += self.sync_wait("allgather", spatial) + self.sync_wait("allreduce", spatial)
            if layer.param_bytes:
                allreduces.append((layer.name, self.gradient_allreduce(layer.param_bytes)))
        if not stage.parents and spatial > 1:
            # the spatial layers learn the global extent of the model's input by one small allreduce per forward
            syncs += 1
            wait += self.sync_wait("allreduce", spatial)
        cost = StageCost(compute, halo, bn, sum(t for _, t in allreduces), allreduces, backward, copies, syncs, wait)
        self._cache[key] = cost
        return cost

    def shuffle(self, nbytes: int, a: Distribution, b: Distribution) -> float:
        """Redistribution between two distributions (section III-C): an all-to-all of each rank's share,
        forward and backward."""
        if a == b or nbytes == 0:
            return 0.0
        share = nbytes / (a.n * a.spatial_size)
        return 2 * (alphabeta.alltoall(share, self.p, self.m) + self.sync_wait("allreduce"))


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _TileCopy(nn.Module):
    """What the timer measures for the halo box: one copy of the tile (its ``repr`` keys the cache)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def _fresh(module: nn.Module) -> nn.Module:
    """A copy with real (random) parameters to time: the planner may receive a meta or trained module."""
    clone = copy.deepcopy(module)
    if any(p.is_meta for p in clone.parameters()):
        clone = clone.to_empty(device="cpu")
    if hasattr(clone, "inplace"):
        # torch types Module.__setattr__ for tensors/modules; the timer needs the input to survive for backward
        clone.inplace = False  # type: ignore[assignment]
    return clone

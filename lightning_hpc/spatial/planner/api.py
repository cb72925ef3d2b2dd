"""Performance model and parallel-execution planner for hybrid sample x spatial parallelism.

Dryden et al., "Improving Strong-Scaling of CNN Training by Exploiting Finer-Grained Parallelism" (IPDPS 2019),
section V:

* V-A, per-layer cost under a distribution ``D = (n, h, w)`` (sample, height and width parts): measured local
  compute (forward + backward at the tile's shape, :class:`lightning_hpc.perfmodel.LayerTimer`), halo exchanges
  ``2 SR(O n C w) + 2 SR(O n C h) + 4 SR(O^2 n C)`` in forward and again in backward, and the weight-gradient
  allreduce ``AR(P, |w|)``, with alpha-beta costs from :mod:`lightning_hpc.perfmodel.alphabeta`.
* V-B, whole network: every layer is measured (not only convolutions: on CPUs batch norm and ReLU are not free),
  spatially aggregated batch norm adds two small allreduces over the spatial group, a change of distribution
  between adjacent layers costs an all-to-all shuffle forward and backward, and the gradient allreduces are
  overlapped greedily with the rest of backpropagation, one allreduce at a time.
* V-C, strategy: candidate distributions per layer, then the shortest path through the candidate graph for line
  networks (:func:`shortest_line_path`), and the longest-path-first heuristic for branching networks (ResNet).

Layers other than convolutions and linear layers inherit the distribution of their parent (a *stage* is a
convolution or linear layer with the layers that follow it).  This module is plain torch: it never imports
Lightning or the spatial layers.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, alphabeta, time_callable
from lightning_hpc.perfmodel.sync import SyncCost
from lightning_hpc.spatial.conv import tile_conv_applies

__all__ = [
    "Distribution",
    "LayerInfo",
    "Stage",
    "StageCost",
    "Plan",
    "trace_layers",
    "build_stages",
    "candidate_distributions",
    "shortest_line_path",
    "plan_for_model",
    "CostModel",
]


@dataclass(frozen=True, order=True)
class Distribution:
    """Parts of the sample (N), height (H) and width (W) dimensions; ``n * h * w`` processes hold distinct data
    and ``replicas`` copies of that layout fill the rest of the world (only for layers too small to split)."""

    n: int
    h: int
    w: int
    replicas: int = 1

    @property
    def spatial(self) -> tuple[int, int]:
        return (self.h, self.w)

    def __str__(self) -> str:
        text = f"N{self.n} x H{self.h} x W{self.w}"
        return text + (f" (x{self.replicas} replicated)" if self.replicas > 1 else "")


@dataclass
class LayerInfo:
    """One node of the traced network: its module (None for functions such as ``add``), shapes and parents."""

    name: str
    module: nn.Module | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    parents: list[str]

    @property
    def decides(self) -> bool:
        """Convolution and linear layers choose a distribution; the others inherit their parent's."""
        return isinstance(self.module, (nn.Conv2d, nn.Linear))

    @property
    def halo(self) -> int:
        """Rows/columns of halo a tile needs from each neighbour (section III-A): ``dilation * (k - 1) / 2``."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            return max(m.dilation[0] * (m.kernel_size[0] - 1), m.dilation[1] * (m.kernel_size[1] - 1)) // 2
        if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
            k = m.kernel_size if isinstance(m.kernel_size, int) else max(m.kernel_size)
            s = m.stride if isinstance(m.stride, int) else max(m.stride)
            return max((k - 1) // 2, 1) if k > s else 0  # overlapping windows need the neighbours' edge
        if isinstance(m, nn.Upsample) and m.mode != "nearest":
            return 1
        return 0

    @property
    def param_bytes(self) -> int:
        if self.module is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.module.parameters(recurse=False) if p.requires_grad)


@dataclass
class Stage:
    """A deciding layer and the layers that inherit its distribution."""

    name: str
    layers: list[LayerInfo]
    parents: list[str] = field(default_factory=list)
    #: bytes of the activation entering from each parent stage (what a shuffle would move)
    edge_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def head(self) -> LayerInfo:
        return self.layers[0]


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

    @property
    def spatial_parts(self) -> tuple[int, int]:
        """(ph, pw) of the input layer: the tile each rank of a spatial group reads."""
        return next(iter(self.distributions.values())).spatial

    @property
    def sample_groups(self) -> int:
        return next(iter(self.distributions.values())).n

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
            "alpha_beta": self.model.to_dict(),
            "loaded_sync": None if self.sync is None else self.sync.to_dict(),
            "layers": [
                {"name": name, "distribution": asdict(d), "label": str(d)} for name, d in self.distributions.items()
            ],
            "stages": {name: {k: v for k, v in asdict(c).items() if k not in ("allreduces", "backward")} | {"total": c.total} for name, c in self.stage_costs.items()},
        }

    def table(self) -> str:
        lines = [
            f"plan for {self.world_size} processes, mini-batch {self.batch_size}, input {list(self.input_shape)} ({self.method})",
            f"{'layer':32s} {'distribution':28s} {'stage cost (ms)':>16s}",
        ]
        for name, dist in self.distributions.items():
            cost = self.stage_costs.get(name)
            lines.append(f"{name:32s} {str(dist):28s} {'' if cost is None else f'{1e3 * cost.total:16.2f}'}")
        lines += [
            f"spatial parts (ph, pw) = {self.spatial_parts}, sample groups = {self.sample_groups}",
            f"compute {1e3 * self.compute_time:.2f} ms + halo {1e3 * self.halo_time:.2f} ms + shuffle {1e3 * self.shuffle_time:.2f} ms"
            f" + loaded sync waits {1e3 * self.sync_time:.2f} ms ({self.sync_points} sync points)"
            f" + exposed allreduce {1e3 * self.exposed_allreduce_time:.2f} ms (of {1e3 * self.allreduce_time:.2f} ms)"
            f" + optimizer {1e3 * self.optimizer_time:.2f} ms",
            f"predicted time per mini-batch: {1e3 * self.predicted_step_time:.2f} ms",
        ]
        return "\n".join(lines)


# ---- network graph ---------------------------------------------------------------------------------------
def trace_layers(model: nn.Module, input_shape: Sequence[int]) -> list[LayerInfo]:
    """Trace ``model`` with torch.fx and propagate shapes on the meta device (nothing is computed)."""
    meta_model = copy.deepcopy(model).to("meta").eval()  # eval: shapes only, BN needs no batch statistics
    gm = fx.symbolic_trace(meta_model)
    ShapeProp(gm).propagate(torch.empty(*input_shape, device="meta"))
    layers: list[LayerInfo] = []
    known: set[str] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        out_shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()
        shapes[node.name] = out_shape
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        parents = [p.name for p in node.all_input_nodes if p.name in known]
        first_input = node.all_input_nodes[0].name if node.all_input_nodes else None
        in_shape = shapes.get(first_input, tuple(input_shape)) if first_input else tuple(input_shape)
        module = model.get_submodule(node.target) if node.op == "call_module" else None
        name = str(node.target) if node.op == "call_module" else node.name
        layers.append(LayerInfo(name=name, module=module, in_shape=in_shape, out_shape=out_shape, parents=parents))
        known.add(node.name)
    # fx names call_module nodes by their path with "_" separators ("block1_0"); report the module path.
    rename = {n.name: (str(n.target) if n.op == "call_module" else n.name) for n in gm.graph.nodes}
    for layer in layers:
        layer.parents = [rename[p] for p in layer.parents]
    return layers


def build_stages(layers: list[LayerInfo]) -> list[Stage]:
    """Group layers into stages (a deciding layer + its followers); stages come in execution order."""
    stage_of: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    by_name = {layer.name: layer for layer in layers}
    for layer in layers:
        if layer.decides or not layer.parents:
            stage = Stage(layer.name, [layer])
            stages[layer.name] = stage
            stage_of[layer.name] = layer.name
        else:
            stage_of[layer.name] = stage_of[layer.parents[0]]
            stage = stages[stage_of[layer.name]]
            stage.layers.append(layer)
        for parent in layer.parents:
            ps = stage_of[parent]
            if ps != stage.name and ps not in stage.parents:
                stage.parents.append(ps)
                shape = by_name[parent].out_shape
                stage.edge_bytes[ps] = 4 * math.prod(shape) if shape else 0
    # A join (residual add) sits in its first parent's stage, so creation order need not be topological.
    ordered: list[Stage] = []
    done: set[str] = set()
    pending = list(stages.values())
    while pending:
        ready = next((st for st in pending if all(p in done for p in st.parents)), None)
        if ready is None:
            raise ValueError("the layer graph has a cycle between stages; cannot plan it")
        ordered.append(ready)
        done.add(ready.name)
        pending.remove(ready)
    return ordered


def _divisors(p: int) -> list[int]:
    return [d for d in range(1, p + 1) if p % d == 0]


def _spatial_extent(layer: LayerInfo) -> tuple[int, int] | None:
    shapes = [s for s in (layer.in_shape, layer.out_shape) if len(s) == 4]
    if not shapes:
        return None
    return min(s[2] for s in shapes), min(s[3] for s in shapes)


def candidate_distributions(stage: Stage, world_size: int, batch_size: int) -> list[Distribution]:
    """Load-balanced distributions ``n x h x w = P`` that every layer of the stage can run (section V-C):
    ``n <= N``, and every tile at least as large as the halo it needs (and one row/column).  When nothing
    fits (e.g. a linear layer with fewer samples than processes), the largest sample split with replicas."""
    out = []
    for n in _divisors(world_size):
        if n > batch_size:
            continue
        rest = world_size // n
        for h in _divisors(rest):
            w = rest // h
            ok = True
            for layer in stage.layers:
                extent = _spatial_extent(layer)
                if extent is None:
                    ok = ok and h == w == 1
                    continue
                need = max(layer.halo, 1)
                ok = ok and extent[0] // h >= need and extent[1] // w >= need
            if ok:
                out.append(Distribution(n, h, w))
    if not out:
        n = max(d for d in _divisors(world_size) if d <= batch_size)
        out.append(Distribution(n, 1, 1, replicas=world_size // n))
    return out


#: "per-layer": one allreduce per parametrised layer as soon as its backward is done (section V-B, greedy
#: overlap); "single": all gradients flattened into one allreduce after backward (no overlap); "bucketed": what
#: torch DDP does, gradients packed in backward order into buckets (the first of DDP_FIRST_BUCKET_BYTES, then
#: DDP_BUCKET_BYTES), each allreduced as soon as it is full, overlapping the rest of backward.
GRADIENT_REDUCTIONS = ("per-layer", "single", "bucketed")
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)


# ---- costs ------------------------------------------------------------------------------------------------
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
            raise ValueError(f"the loaded sync calibration was measured on {sync.world_size} processes but the plan is for "
                             f"{world_size}; measure it with perfmodel.sync.calibrate_sync({world_size})")
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
        if len(shape) == 4:
            return (n, shape[1], math.ceil(shape[2] / d.h), math.ceil(shape[3] / d.w))
        return (n, *shape[1:])

    def _halo(self, layer: LayerInfo, d: Distribution) -> float:
        """One halo exchange (section V-A): east/west, north/south and corner send/recvs."""
        o = layer.halo
        if o == 0 or len(layer.in_shape) != 4 or (d.h == 1 and d.w == 1):
            return 0.0
        n, c, hl, wl = self.local_shape(layer.in_shape, d)
        sr = lambda elems: alphabeta.send_recv(elems * self.bytes, self.m)  # noqa: E731
        cost = 0.0
        if d.h > 1:
            cost += 2 * sr(o * n * c * wl)
        if d.w > 1:
            cost += 2 * sr(o * n * c * hl)
        if d.h > 1 and d.w > 1:
            cost += 4 * sr(o * o * n * c)
        return cost

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
        spatial = d.h * d.w
        for layer in stage.layers:
            if layer.module is not None and layer.in_shape:
                shape = self.local_shape(layer.in_shape, d)
                module = _fresh(layer.module)
                if isinstance(module, nn.modules.batchnorm._BatchNorm) and math.prod(shape) // shape[1] == 1:
                    module.eval()  # one value per channel on this tile: the statistics come from the group
                t = self.timer.measure(module, shape, device=self.device)
                fwd, bwd = self.compute_scale * t["forward"], self.compute_scale * t["backward"]
            else:
                fwd = bwd = 0.0  # element-wise functions (residual adds, flatten) are treated as free
            x = self._halo(layer, d)
            # the network's input needs no gradient, so its layer exchanges no halo in backward
            x_bwd = x if layer.parents else 0.0
            if x > 0 and layer.module is not None and not (
                isinstance(layer.module, nn.Conv2d) and tile_conv_applies(layer.module, *layer.in_shape[-2:], (d.h, d.w))
            ):
                # the spatial layer copies its tile into a box with the halo (forward) and rebuilds it (backward);
                # a convolution on stride-aligned tiles convolves the tile in place and copies only edge rows
                copies += 2 * self.compute_scale * self.timer.measure(_TileCopy(), self.local_shape(layer.in_shape, d), device=self.device)["forward"]
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
            if isinstance(layer.module, nn.BatchNorm2d) and self.aggregate_bn and spatial > 1:
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
        share = nbytes / (a.n * a.h * a.w)
        return 2 * (alphabeta.alltoall(share, self.p, self.m) + self.sync_wait("allreduce"))


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
        clone.inplace = False  # the timer needs the input to survive for backward
    return clone


# ---- strategy search ---------------------------------------------------------------------------------------
def shortest_line_path(
    candidates: Sequence[Sequence[Any]],
    cost: Callable[[int, Any], float],
    shuffle: Callable[[int, Any, Any], float],
) -> tuple[list[Any], float]:
    """Shortest source-to-sink path through the candidate graph of a line network (section V-C).

    Vertex ``(i, D)`` for each candidate ``D`` of layer ``i``; edge ``(i, D) -> (i+1, D')`` weighs
    ``cost(i, D) + shuffle(i, D, D')``; the last layer's vertices reach the sink with ``cost(L-1, D)``.  The graph
    is a DAG in layer order, so one relaxation sweep (dynamic programming) finds the optimum in linear time.
    Returns the chosen candidate per layer and the path length.
    """
    if not candidates or any(len(c) == 0 for c in candidates):
        raise ValueError("every layer needs at least one candidate distribution")
    best = [0.0 for _ in candidates[0]]  # source -> (0, D): weight 0
    back: list[list[int]] = []
    for i in range(1, len(candidates)):
        row, arg = [], []
        for dj in candidates[i]:
            options = [best[k] + cost(i - 1, di) + shuffle(i - 1, di, dj) for k, di in enumerate(candidates[i - 1])]
            k = min(range(len(options)), key=options.__getitem__)
            row.append(options[k])
            arg.append(k)
        best, back = row, back + [arg]
    last = len(candidates) - 1
    final = [best[k] + cost(last, d) for k, d in enumerate(candidates[last])]
    k = min(range(len(final)), key=final.__getitem__)
    total, choice = final[k], [k]
    for arg in reversed(back):
        choice.append(arg[choice[-1]])
    choice.reverse()
    return [candidates[i][k] for i, k in enumerate(choice)], total


def _line_paths_order(stages: list[Stage], weight: dict[str, float], fixed: set[str]) -> list[str]:
    """Heaviest source-to-sink path of the stage DAG counting only unfixed stages (longest path first)."""
    index = {s.name: i for i, s in enumerate(stages)}
    score: dict[str, tuple[float, int]] = {}
    prev: dict[str, str | None] = {}
    for s in stages:  # stages are in topological (execution) order
        own = (0.0 if s.name in fixed else weight[s.name], -1 if s.name in fixed else 0)
        if not s.parents:
            score[s.name], prev[s.name] = own, None
            continue
        p = max(s.parents, key=lambda q: (score[q], -index[q]))
        score[s.name] = (score[p][0] + own[0], score[p][1] + own[1])
        prev[s.name] = p
    children = {s.name: 0 for s in stages}
    for s in stages:
        for p in s.parents:
            children[p] += 1
    sinks = [s.name for s in stages if children[s.name] == 0]
    end = max(sinks, key=lambda q: score[q])
    path = [end]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    return path[::-1]


def _is_line(stages: list[Stage]) -> bool:
    return all(len(s.parents) <= 1 for s in stages) and all(
        sum(1 for t in stages if s.name in t.parents) <= 1 for s in stages
    )


def _assign(stages: list[Stage], cands: dict[str, list[Distribution]], costs: CostModel, uniform: bool) -> tuple[dict[str, Distribution], str]:
    by_name = {s.name: s for s in stages}

    def solve(path: list[str], options: dict[str, list[Distribution]]) -> list[Distribution]:
        choice, _ = shortest_line_path(
            [options[n] for n in path],
            lambda i, d: costs.stage_cost(by_name[path[i]], d).total,
            lambda i, a, b: costs.shuffle(by_name[path[i + 1]].edge_bytes.get(path[i], 0), a, b),
        )
        return choice

    if uniform:  # one distribution for the whole network (what the paper's experiments use)
        common = set(cands[stages[0].name])
        for s in stages[1:]:
            common &= set(cands[s.name])
        if not common:
            raise ValueError("no single distribution fits every layer; plan per layer (uniform=False)")
        best = min(sorted(common), key=lambda d: sum(costs.stage_cost(s, d).total for s in stages))
        return {s.name: best for s in stages}, "uniform"
    if _is_line(stages):
        path = [s.name for s in stages]
        return dict(zip(path, solve(path, cands))), "shortest-path"
    # Branching network: longest path first, then the next longest over the unassigned layers (section V-C).
    weight = {s.name: min(costs.stage_cost(s, d).total for d in cands[s.name]) for s in stages}
    fixed: dict[str, Distribution] = {}
    while len(fixed) < len(stages):
        path = _line_paths_order(stages, weight, set(fixed))
        if all(n in fixed for n in path):  # remaining stages are off every heaviest path: take one directly
            name = next(s.name for s in stages if s.name not in fixed)
            path = [name]
        options = {n: ([fixed[n]] if n in fixed else cands[n]) for n in path}
        for n, d in zip(path, solve(path, options)):
            fixed.setdefault(n, d)
    return fixed, "longest-path-first"


def _simulate(stages: list[Stage], assignment: dict[str, Distribution], costs: CostModel) -> dict[str, float]:
    """Time per mini-batch of an assignment (section V-B): local costs and shuffles add up; the gradient
    allreduces start when their layer's backward is done (or their bucket is full) and run one at a time,
    overlapping what is left.  With a loaded-sync calibration only the measured fraction of an allreduce that
    computation can hide (:attr:`SyncCost.overlap_fraction`) is hidden: the rest takes the cores from backward."""
    chosen = [(s, costs.stage_cost(s, assignment[s.name])) for s in stages]
    local = sum(c.local for _, c in chosen)
    compute = sum(c.compute for _, c in chosen)
    halo = sum(c.halo + c.copies + c.bn_stats for _, c in chosen)
    sync_time = sum(c.sync_wait for _, c in chosen)
    sync_points = sum(c.sync_points for _, c in chosen)
    moves = [(s.edge_bytes.get(p, 0), assignment[p], assignment[s.name]) for s in stages for p in s.parents]
    shuffle = sum(costs.shuffle(*m) for m in moves)
    sync_points += 2 * sum(1 for nbytes, a, b in moves if nbytes and a != b)
    # Walk backward in reverse layer order: clock advances by each layer's backward; its allreduce queues.
    fwd_total = sum(c.local - sum(t for _, t in c.backward) for _, c in chosen)
    clock = fwd_total + shuffle / 2
    events: list[tuple[float, float]] = []
    bucket, bucket_cap = 0, DDP_FIRST_BUCKET_BYTES
    for s, c in reversed(chosen):
        ar = dict(c.allreduces)
        nbytes_of = {layer.name: layer.param_bytes for layer in s.layers}
        for name, bwd in reversed(c.backward):
            clock += bwd
            if costs.gradient_reduction == "per-layer" and name in ar:
                events.append((clock, ar[name]))
            elif costs.gradient_reduction == "bucketed" and nbytes_of.get(name):
                bucket += nbytes_of[name]
                if bucket >= bucket_cap:
                    events.append((clock, costs.gradient_allreduce(bucket)))
                    bucket, bucket_cap = 0, DDP_BUCKET_BYTES
    clock += shuffle / 2
    if costs.gradient_reduction == "bucketed" and bucket:
        events.append((clock, costs.gradient_allreduce(bucket)))
    if costs.gradient_reduction == "single":
        nbytes = sum(layer.param_bytes for s in stages for layer in s.layers)
        events = [(clock, costs.gradient_allreduce(nbytes))] if nbytes else []
    busy_until = 0.0
    for ready, t in events:
        busy_until = max(busy_until, ready) + t
    total_ar = sum(t for _, t in events)
    sync_points += len(events) if costs.p > 1 else 0
    hideable = 1.0 if costs.sync is None else costs.sync.overlap_fraction
    end = max(clock + (1.0 - hideable) * total_ar, busy_until)
    return {
        "local": local,
        "compute": compute,
        "halo": halo,
        "shuffle": shuffle,
        "allreduce": total_ar,
        "exposed_allreduce": max(end - clock, 0.0),
        "end": end,
        "sync_time": sync_time,
        "sync_points": sync_points,
    }


def _optimizer_time(model: nn.Module, optimizer: str = "sgd") -> float:
    params = [torch.nn.Parameter(torch.randn_like(p, device="cpu")) for p in _fresh(model).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-3)
    return time_callable(opt.step, warmup=1, repeats=3)


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
) -> Plan:
    """Choose a distribution for every layer of ``model`` on ``world_size`` processes at mini-batch
    ``batch_size`` (``input_shape`` = (C, H, W) of one sample) and predict the time per mini-batch.

    ``alpha_beta``: the interconnect (default: :func:`lightning_hpc.perfmodel.calibrate_local` on 2 local
    processes, cached).  ``uniform=True`` keeps one distribution for all layers (the setting of the paper's
    experiments, and what a strategy with a single ``spatial_parts`` runs).  ``restrict`` filters candidates
    (e.g. ``lambda d: d.h == d.w == 1`` for pure sample parallelism).  ``compute_scale`` multiplies measured
    compute, e.g. ``processes / cores`` when ranks share too few cores.  ``gradient_reduction``: see
    :data:`GRADIENT_REDUCTIONS` (the paper's per-layer overlapped allreduces, one fused allreduce, or DDP's
    buckets).  ``sync``: the measured cost of a synchronisation between busy ranks
    (:func:`lightning_hpc.perfmodel.sync.calibrate_sync` on ``world_size`` processes); every halo exchange,
    batch-norm collective, shuffle and gradient allreduce of the plan is then charged its alpha-beta cost plus
    that measured extra, and only the measured share of an allreduce is hidden behind backward.  Default None:
    the plain alpha-beta model of section V-A (right for ranks with cores to spare).

    Called inside a distributed job, rank 0 plans (alpha-beta calibrated on the job's process group) and
    broadcasts the plan, so every rank uses the same one.
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Inside a job (a strategy planning at setup): measured times differ between ranks, so rank 0 plans and
        # every rank gets the same plan; alpha-beta is calibrated on the job's own process group (collective).
        if alpha_beta is None:
            from lightning_hpc.perfmodel import calibrate

            alpha_beta = calibrate()
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = _plan(model, input_shape, world_size, batch_size, alpha_beta, timer, uniform, restrict, overlap_halo, aggregate_bn, compute_scale, optimizer, device, gradient_reduction, sync)
            except Exception as e:  # every rank must leave the broadcast, then all raise the same error
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]
    return _plan(model, input_shape, world_size, batch_size, alpha_beta, timer, uniform, restrict, overlap_halo, aggregate_bn, compute_scale, optimizer, device, gradient_reduction, sync)


def _plan(
    model: nn.Module,
    input_shape: Sequence[int],
    world_size: int,
    batch_size: int,
    alpha_beta: AlphaBeta | None,
    timer: LayerTimer | None,
    uniform: bool,
    restrict: Callable[[Distribution], bool] | None,
    overlap_halo: bool,
    aggregate_bn: bool,
    compute_scale: float,
    optimizer: str,
    device: str | torch.device,
    gradient_reduction: str,
    sync: SyncCost | None = None,
) -> Plan:
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (C, H, W) of one sample, got {list(input_shape)}")
    if alpha_beta is None:
        from lightning_hpc.perfmodel import calibrate_local

        alpha_beta = calibrate_local(2)
    layers = trace_layers(model, (batch_size, *input_shape))
    stages = build_stages(layers)
    costs = CostModel(alpha_beta, world_size, batch_size, timer, overlap_halo, aggregate_bn, compute_scale, device=device, gradient_reduction=gradient_reduction, sync=sync)
    cands = {}
    for s in stages:
        options = candidate_distributions(s, world_size, batch_size)
        if restrict is not None:
            kept = [d for d in options if restrict(d)]
            if not kept:
                raise ValueError(f"no candidate distribution of layer {s.name} (input {list(s.head.in_shape)}) passes the restriction; candidates: {[str(d) for d in options]}")
            options = kept
        cands[s.name] = options
    assignment, method = _assign(stages, cands, costs, uniform)
    sim = _simulate(stages, assignment, costs)
    opt = compute_scale * _optimizer_time(model, optimizer)
    stage_of = {}
    for s in stages:
        for layer in s.layers:
            stage_of[layer.name] = s.name
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
    )


def brute_force_line(candidates: Sequence[Sequence[Any]], cost: Callable[[int, Any], float], shuffle: Callable[[int, Any, Any], float]) -> tuple[list[Any], float]:
    """Exhaustive search over every assignment (reference for :func:`shortest_line_path`; small graphs only)."""
    best, best_total = None, math.inf
    for combo in itertools.product(*candidates):
        total = sum(cost(i, d) for i, d in enumerate(combo)) + sum(shuffle(i, combo[i], combo[i + 1]) for i in range(len(combo) - 1))
        if total < best_total:
            best, best_total = list(combo), total
    return best, best_total

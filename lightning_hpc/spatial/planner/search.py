"""Parallel execution strategy search (Dryden et al., IPDPS 2019, section V-C).

Candidate distributions per stage (load balanced, every tile at least as large as its halo), then the shortest
source-to-sink path through the candidate graph for line networks (:func:`shortest_line_path`), and the
longest-path-first heuristic for branching networks (ResNet): the heaviest path is solved first and fixed, then
the next heaviest over the stages still unassigned, until every stage has a distribution.  Plain torch: no
Lightning import.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning_hpc.spatial.dispatch.windows import split_works
from lightning_hpc.spatial.planner.cost import CostModel
from lightning_hpc.spatial.planner.graph import Distribution, LayerInfo, Stage

__all__ = ["candidate_distributions", "shortest_line_path", "brute_force_line"]



class NoSingleSplitError(ValueError):
    """No one distribution suits every layer of the model at this size (a planned ``uniform`` run is impossible;
    a per-layer plan may exist)."""

def _divisors(p: int) -> list[int]:
    return [d for d in range(1, p + 1) if p % d == 0]


def _spatial_splits(rest: int, k: int) -> list[tuple[int, ...]]:
    """Every ``(p_1, ..., p_k)`` with product ``rest``."""
    if k == 1:
        return [(rest,)]
    return [(p, *tail) for p in _divisors(rest) for tail in _spatial_splits(rest // p, k - 1)]


def _model_ndim(stage: Stage) -> int:
    return max((layer.spatial_ndim for layer in stage.layers if len(layer.in_shape) >= 3), default=0)


def _layer_splits(layer: LayerInfo, k: int, parts: tuple[int, ...]) -> bool:
    """Whether ``layer`` runs with its ``k`` spatial dimensions split ``parts``: every tile of its input and output
    holds a row, and its windows' halo plan exists; a layer without spatial dimensions (a linear head) only
    unsplit."""
    if not layer.out_shape:
        return True  # no tensor out (a shape query such as ``x.shape[2]``): nothing to split
    shapes = [s for s in (layer.in_shape, layer.out_shape) if k and len(s) == 2 + k]
    if not shapes:
        return all(p == 1 for p in parts)
    if not all(split_works(None, s[2:], parts) for s in shapes):
        return False
    return len(layer.in_shape) != 2 + k or split_works(layer.windows, layer.in_shape[2:], parts)


def candidate_distributions(
    stage: Stage, world_size: int, batch_size: int, ndim: int | None = None
) -> list[Distribution]:
    """Load-balanced distributions ``n x [d x] h x w = P`` that every layer of the stage can run (section V-C):
    ``n <= N``, and every tile at least one row and the halo it needs (the halo plan's own test, from the
    layer's windows).  ``ndim``: the spatial dimensions of the model's input (1, 2 or 3; default: the stage's
    largest).  When nothing fits (e.g. a linear layer with fewer samples than processes), the largest sample
    split with replicas."""
    k = ndim if ndim is not None else _model_ndim(stage)
    out = []
    for n in _divisors(world_size):
        if n > batch_size:
            continue
        rest = world_size // n
        for parts in _spatial_splits(rest, k) if k else ([()] if rest == 1 else []):
            if all(_layer_splits(layer, k, parts) for layer in stage.layers):
                full = (1,) * (3 - k) + tuple(parts)
                out.append(Distribution(n, full[1], full[2], d=full[0]))
    if not out:
        n = max(d for d in _divisors(world_size) if d <= batch_size)
        out.append(Distribution(n, 1, 1, replicas=world_size // n))
    return out


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
    parents = {p for s in stages for p in s.parents}
    end = max((s.name for s in stages if s.name not in parents), key=lambda q: score[q])  # the heaviest sink
    path = [end]
    while (before := prev[path[-1]]) is not None:
        path.append(before)
    return path[::-1]


def _is_line(stages: list[Stage]) -> bool:
    return all(len(s.parents) <= 1 for s in stages) and all(
        sum(1 for t in stages if s.name in t.parents) <= 1 for s in stages
    )


def _assign(
    stages: list[Stage], cands: dict[str, list[Distribution]], costs: CostModel, uniform: bool
) -> tuple[dict[str, Distribution], str]:
    by_name = {s.name: s for s in stages}

    def solve(path: list[str], options: dict[str, list[Distribution]]) -> list[Distribution]:
        choice, _ = shortest_line_path(
            [options[n] for n in path],
            lambda i, d: costs.stage_cost(by_name[path[i]], d).total,
            lambda i, a, b: costs.shuffle(by_name[path[i + 1]].edge_bytes.get(path[i], 0), a, b),
        )
        return choice

    if uniform:  # one distribution for the whole network (what the paper's experiments use)
        common = set.intersection(*(set(cands[s.name]) for s in stages))
        if not common:
            raise NoSingleSplitError("no single distribution fits every layer; plan per layer (uniform=False)")
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


def brute_force_line(
    candidates: Sequence[Sequence[Any]],
    cost: Callable[[int, Any], float],
    shuffle: Callable[[int, Any, Any], float],
) -> tuple[list[Any] | None, float]:
    """Exhaustive search over every assignment (reference for :func:`shortest_line_path`; small graphs only);
    ``(None, inf)`` when a layer has no candidate."""
    best: list[Any] | None = None
    best_total = math.inf
    for combo in itertools.product(*candidates):
        total = sum(cost(i, d) for i, d in enumerate(combo)) + sum(
            shuffle(i, combo[i], combo[i + 1]) for i in range(len(combo) - 1)
        )
        if total < best_total:
            best, best_total = list(combo), total
    return best, best_total

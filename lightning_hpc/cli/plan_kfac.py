"""``lightning-hpc plan-kfac``: who decomposes which K-FAC factor, how balanced that is, and what each
gradient-worker fraction costs in memory and communication.

    lightning-hpc plan-kfac --model resnet50 --world-size 16 --placement round_robin [--json]

The model is built on the meta device (no memory, no weights); its Linear / Conv2d layers give the factor sides
``n`` (A: ``C_in * kh * kw`` + bias, G: ``C_out``). For each rank it prints the factors it owns, the sum of their
element counts (``n^2``: memory and broadcast payload) and of their costs (``n^3``: decomposition work), then the
max, mean and lower-bound cost (``max(largest factor, total / world)``), the quantities of section VI-C4.

Then, for every valid ``grad_worker_fraction`` (KAISA, SC21; or the ``--grad-worker-fraction`` values
given), the per-rank memory of the running factors plus the decompositions the rank holds, and the bytes each
rank hands to collectives per step kind (:func:`communication_plan`, computed from the layer shapes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_hpc.kfac.discovery import find_layers
from lightning_hpc.kfac.forms import DenseForm, LayerDims, LayerForms, layer_forms
from lightning_hpc.kfac.layers import LAYER_TYPES
from lightning_hpc.kfac.methods import COMPUTE_METHODS, make_method
from lightning_hpc.kfac.placement import (
    PLACEMENTS,
    GradWorkerGrid,
    assign_factors,
    grad_workers_for,
    make_placement,
    placement_summary,
)

__all__ = ["communication_plan", "main", "model_factor_dims", "plan", "valid_fractions"]


def model_factor_dims(model_name: str, layer_types: Sequence[str] | None = None) -> tuple[list[str], list[LayerDims]]:
    """Names and ``(n_A, n_G)`` of the K-FAC layers of a model-zoo model, built on the meta device (the
    :class:`~.forms.LayerForms` of a layer whose factors are not two dense ones: normalisation, embedding), for the
    layers the preconditioner would register with ``layer_types`` (None: every family)."""
    from lightning_hpc.models import build_model

    with torch.device("meta"):
        model = build_model(model_name)
    names, dims = [], []
    for h in find_layers(model, [], layer_types).handlers:
        names.append(h.name)
        forms = h.layer_forms()
        dense = all(isinstance(f, DenseForm) for f in forms.factors.values()) and list(forms.factors) == ["A", "G"]
        dims.append((h.a_dim, h.g_dim) if dense else forms)
    return names, dims


def valid_fractions(world_size: int) -> list[float]:
    """Every gradient-worker fraction a world of ``world_size`` ranks accepts: ``d / world`` for the divisors d."""
    return [d / world_size for d in range(1, world_size + 1) if world_size % d == 0]


def communication_plan(
    layer_dims: Sequence[LayerDims],
    world_size: int,
    placement: str = "balanced",
    grad_worker_fraction: float | None = None,
    *,
    compute_method: str = "eigen",
    symmetric_allreduce: bool = True,
    element_bytes: int = 4,
    decomposition_bytes: int = 4,
    factor_bytes: int | None = None,
    inverse_bytes: int | None = None,
    factor_update_freq: int = 10,
    inv_update_freq: int = 100,
) -> dict[str, Any]:
    """Per-rank memory and communication of K-FAC with a gradient-worker fraction (KAISA, SC21), from
    the layers' factor sides ``layer_dims[i] = (n_A, n_G)`` alone (the preconditioner's own assignment rule), or
    their :class:`~.forms.LayerForms` (normalisation layers' per-channel blocks, embeddings' diagonal A: each
    factor priced as its form stores, packs and decomposes it).

    Memory (bytes, per rank): ``factors_bytes`` -- every layer's running A and G (``n^2`` elements of
    ``factor_bytes``, default ``element_bytes``; every rank holds all of them); ``decompositions_bytes`` -- the
    decompositions of the layers of the rank's gradient-worker group (eigen: ``n + n^2`` per factor, inverse:
    ``n^2``; ``inverse_bytes`` each, default ``decomposition_bytes``).

    Communication (bytes of the tensors the rank hands to collectives, sender or receiver, per step kind):
    ``factor_allreduce_bytes`` on factor-update steps (the factors' upper triangles, or whole matrices without
    ``symmetric_allreduce``, in ``element_bytes``, plus one 4-byte "hooks fired" flag per layer);
    ``decomposition_broadcast_bytes`` on decomposition steps (the decompositions of the rank's worker group,
    broadcast within it: 0 at one worker per layer); ``gradient_broadcast_bytes`` on every step (every layer's
    ``n_G x n_A`` preconditioned gradient in ``decomposition_bytes``, broadcast within the rank's broadcast
    group: 0 at fraction 1); ``bytes_per_step`` amortises them over the two intervals. One process
    communicates nothing.
    """
    world = world_size
    policy = make_placement(placement)
    workers = (
        policy.default_grad_workers(world)
        if grad_worker_fraction is None
        else grad_workers_for(grad_worker_fraction, world)
    )
    grid = GradWorkerGrid(world, workers)
    columns, _ = policy.assign_grid(layer_dims, grid)
    method = make_method(compute_method)
    fbytes = element_bytes if factor_bytes is None else factor_bytes
    ibytes = decomposition_bytes if inverse_bytes is None else inverse_bytes

    layers = [layer_forms(d) for d in layer_dims]

    def decomposition_elements(layer: LayerForms) -> int:
        return sum(math.prod(s) for f in layer.factors.values() for s in f.result_shapes(method).values())

    factors = sum(f.numel for layer in layers for f in layer.factors.values()) * fbytes
    allreduce = 0
    if world > 1:
        packed = sum(f.packed_numel(symmetric_allreduce) for layer in layers for f in layer.factors.values())
        allreduce = packed * element_bytes + 4 * len(layer_dims)
    gradients = (
        sum(math.prod(layer.grad_shape) for layer in layers) * decomposition_bytes
        if world > 1 and grid.broadcasts_gradients else 0
    )  # fmt: skip
    ranks = []
    for r in range(world):
        mine = [layer for layer, c in zip(layers, columns) if c == grid.column_of(r)]
        held = sum(decomposition_elements(layer) for layer in mine) * ibytes
        shared = held if world > 1 and grid.shares_decompositions else 0
        ranks.append({
            "rank": r,
            "layers": len(mine),
            "factors_bytes": factors,
            "decompositions_bytes": held,
            "memory_bytes": factors + held,
            "factor_allreduce_bytes": allreduce,
            "decomposition_broadcast_bytes": shared,
            "gradient_broadcast_bytes": gradients,
            "bytes_per_step": allreduce / factor_update_freq + shared / inv_update_freq + gradients,
        })
    return {
        "world_size": world,
        "placement": placement,
        "grad_worker_fraction": workers / world,
        "grad_workers": workers,
        "worker_groups": grid.num_groups,
        "compute_method": compute_method,
        "factor_update_freq": factor_update_freq,
        "inv_update_freq": inv_update_freq,
        "max_memory_bytes": max(r["memory_bytes"] for r in ranks),
        "max_bytes_per_step": max(r["bytes_per_step"] for r in ranks),
        "ranks": ranks,
    }


def plan(
    model_name: str, world_size: int, placement: str, fractions: Sequence[float] | None = None,
    layer_types: Sequence[str] | None = None, **comm_options: Any
) -> dict[str, Any]:
    names, dims = model_factor_dims(model_name, layer_types)
    summary = placement_summary(dims, world_size, assign_factors(dims, world_size, placement))
    for r in summary["ranks"]:  # "12A" -> "layer1.0.conv2.A"
        r["factors"] = [f"{names[int(f[:-1])]}.{f[-1]}" for f in r["factors"]]
    kaisa = [
        communication_plan(dims, world_size, placement, f, **comm_options)
        for f in (fractions or valid_fractions(world_size))
    ]
    n_factors = sum(len(layer_forms(d).factors) for d in dims)
    return {"model": model_name, "placement": placement, "layers": len(dims), "factors": n_factors, **summary,
            "grad_worker_fractions": kaisa}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _table(p: dict[str, Any]) -> str:
    lines = [
        f"K-FAC placement plan: {p['model']} ({p['layers']} layers, {p['factors']} factors), "
        f"world size {p['world_size']}, placement {p['placement']}",
        f"{'rank':>5} {'factors':>8} {'elements (n^2)':>15} {'cost (n^3)':>14}  factors",
    ]
    for r in p["ranks"]:
        shown = ", ".join(r["factors"][:4]) + (f", ... (+{len(r['factors']) - 4})" if len(r["factors"]) > 4 else "")
        lines.append(f"{r['rank']:>5} {len(r['factors']):>8} {r['numel']:>15,} {r['cost']:>14.3e}  {shown}")
    lines += [
        f"max cost         {p['max_cost']:.3e}",
        f"mean cost        {p['mean_cost']:.3e}",
        f"lower bound      {p['lower_bound_cost']:.3e}   (max(largest factor, total / world))",
        f"max / mean       {p['max_over_mean']:.3f}",
        f"max / lower bnd  {p['max_over_lower_bound']:.3f}",
        "",
        "grad_worker_fraction (KAISA): per-rank memory (factors + decompositions) and bytes handed to collectives, MiB",
        f"{'fraction':>9} {'workers':>8} {'memory max':>11} {'memory min':>11} {'factor step':>12} {'decomp step':>12} "
        f"{'every step':>11} {'per step':>9}",
    ]
    for k in p["grad_worker_fractions"]:
        ranks = k["ranks"]
        lines.append(
            f"{k['grad_worker_fraction']:>9.4g} {k['grad_workers']:>8} {_mib(k['max_memory_bytes']):>11} "
            f"{_mib(min(r['memory_bytes'] for r in ranks)):>11} "
            f"{_mib(max(r['factor_allreduce_bytes'] for r in ranks)):>12} "
            f"{_mib(max(r['decomposition_broadcast_bytes'] for r in ranks)):>12} "
            f"{_mib(max(r['gradient_broadcast_bytes'] for r in ranks)):>11} {_mib(k['max_bytes_per_step']):>9}"
        )
    if p["grad_worker_fractions"]:
        k = p["grad_worker_fractions"][0]
        lines.append(
            f"(per step: factor step / {k['factor_update_freq']} + decomposition step / {k['inv_update_freq']} "
            "+ every step; "
            f"compute method {k['compute_method']}; max over ranks)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-hpc plan-kfac", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="resnet50", help="model-zoo name: resnet18..152, cifar_resnet20..110, alexnet, small_cnn"
    )
    parser.add_argument("--world-size", type=int, default=16, help="number of data-parallel ranks")
    parser.add_argument("--placement", default="balanced", choices=PLACEMENTS)
    parser.add_argument("--grad-worker-fraction", type=float, action="append", default=None, metavar="F",
                        help="KAISA fraction to report (repeatable); default: every valid fraction for the world size")
    parser.add_argument("--compute-method", default="eigen", choices=tuple(COMPUTE_METHODS))
    parser.add_argument("--layer-types", nargs="+", default=None, choices=tuple(LAYER_TYPES), metavar="TYPE",
                        help=f"layer families K-FAC preconditions (KFAC(layer_types=...)): {', '.join(LAYER_TYPES)}; "
                             "default: all")
    parser.add_argument("--factor-update-freq", type=int, default=10, help="steps between factor updates")
    parser.add_argument("--inv-update-freq", type=int, default=100, help="steps between decompositions")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.factor_update_freq < 1 or args.inv_update_freq < 1:
        parser.error("--factor-update-freq and --inv-update-freq must be >= 1")
    try:
        p = plan(
            args.model,
            args.world_size,
            args.placement,
            args.grad_worker_fraction,
            args.layer_types,
            compute_method=args.compute_method,
            factor_update_freq=args.factor_update_freq,
            inv_update_freq=args.inv_update_freq,
        )
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(p, indent=2) if args.json else _table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

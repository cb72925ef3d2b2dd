"""``lightning-hpc plan-kfac``: who decomposes which K-FAC factor, and how balanced that is.

    lightning-hpc plan-kfac --model resnet50 --world-size 16 --placement round_robin [--json]

The model is built on the meta device (no memory, no weights); its Linear / Conv2d layers give the factor sides
``n`` (A: ``C_in * kh * kw`` + bias, G: ``C_out``). For each rank it prints the factors it owns, the sum of their
element counts (``n^2``: memory and broadcast payload) and of their costs (``n^3``: decomposition work), then the
max, mean and lower-bound cost (``max(largest factor, total / world)``), the quantities of section VI-C4.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_hpc.kfac.layers import make_handler
from lightning_hpc.kfac.placement import PLACEMENTS, assign_factors, placement_summary

__all__ = ["main", "model_factor_dims", "plan"]


def model_factor_dims(model_name: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Names and ``(n_A, n_G)`` of the K-FAC layers of a model-zoo model, built on the meta device."""
    from lightning_hpc.models import build_model

    with torch.device("meta"):
        model = build_model(model_name)
    names, dims = [], []
    for name, module in model.named_modules():
        h = make_handler(name, module)
        if h is not None:
            names.append(name)
            dims.append((h.a_dim, h.g_dim))
    return names, dims


def plan(model_name: str, world_size: int, placement: str) -> dict[str, Any]:
    names, dims = model_factor_dims(model_name)
    summary = placement_summary(dims, world_size, assign_factors(dims, world_size, placement))
    for r in summary["ranks"]:  # "12A" -> "layer1.0.conv2.A"
        r["factors"] = [f"{names[int(f[:-1])]}.{f[-1]}" for f in r["factors"]]
    return {"model": model_name, "placement": placement, "layers": len(dims), **summary}


def _table(p: dict[str, Any]) -> str:
    lines = [
        f"K-FAC placement plan: {p['model']} ({p['layers']} layers, {2 * p['layers']} factors), "
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
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-hpc plan-kfac", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="model-zoo name: resnet18..152, cifar_resnet20..110, alexnet, small_cnn")
    parser.add_argument("--world-size", type=int, default=16, help="number of data-parallel ranks")
    parser.add_argument("--placement", default="balanced", choices=PLACEMENTS)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    try:
        p = plan(args.model, args.world_size, args.placement)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(p, indent=2) if args.json else _table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

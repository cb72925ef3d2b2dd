"""``lightning-hpc plan-spatial``: the planner of Dryden et al. section V on a recipe's model.

    lightning-hpc plan-spatial recipe=mesh_tangling_1k --world-size 8 [--json] [key=value ...]

Prints the split the strategy would run (one ``spatial_parts`` for the whole model, as
``SpatialParallelStrategy`` runs it; ``--per-layer``: the paper's search, a distribution per layer, with shuffles
between them), each layer's distribution and stage cost under it, the predicted time per mini-batch and the
predicted memory per rank (:meth:`~lightning_hpc.spatial.planner.Plan.memory_per_rank`: each layer's output at the
rank's tile and the parameters with their gradients, beside one process's).  Layer
times are measured on this machine the first time (cached in ``$LIGHTNING_HPC_CACHE``; progress goes to stderr,
stage by stage); alpha and beta come from a short gloo calibration between two local processes unless given
(``--alpha/--beta``, e.g. measured on the target cluster).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main", "load_recipe"]


def load_recipe(recipe: str, overrides: Sequence[str] = ()):
    """Compose ``recipes/<recipe>.yaml`` with the config groups, without running anything."""
    from hydra import compose, initialize_config_dir

    from lightning_hpc.cli.config_paths import conf_dir, recipe_names, recipes_dir

    if recipe not in recipe_names():
        raise ValueError(f"unknown recipe {recipe!r}; available: {', '.join(recipe_names())}")
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return compose(config_name=recipe, overrides=[*overrides, f"hydra.searchpath=[file://{conf_dir()}]"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-hpc plan-spatial", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="recipe=NAME and Hydra overrides (e.g. input_shape=[18,256,256])")
    p.add_argument("--world-size", type=int, required=True, help="number of processes")
    p.add_argument("--batch-size", type=int, default=None, help="mini-batch size N (default: the recipe's batch_size)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--per-layer", action="store_true",
                   help="a distribution per layer (the paper's search; the strategy runs one split for all layers)")
    p.add_argument("--sample-only", action="store_true", help="pure sample (data) parallelism")
    p.add_argument("--overlap-halo", action="store_true", help="model halo exchanges hidden behind interior compute")
    p.add_argument("--local-bn", action="store_true", help="tile-local batch norm (no statistics allreduce)")
    p.add_argument(
        "--gradient-reduction",
        choices=("per-layer", "single", "bucketed"),
        default="per-layer",
        help="per-layer allreduces overlapped with backward (paper), one fused allreduce after it, or DDP's buckets",
    )
    p.add_argument("--loaded-sync", action="store_true",
                   help="measure (once, cached) what a synchronisation costs between --world-size busy local processes "
                        "and charge it at every synchronisation point (for ranks sharing this machine's cores)")
    p.add_argument("--alpha", type=float, default=None, help="latency in seconds (skips calibration with --beta)")
    p.add_argument("--beta", type=float, default=None, help="inverse bandwidth in seconds per byte")
    p.add_argument(
        "--cores", type=int, default=None, help="cores the processes share (scales compute when oversubscribed)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process when timing layers")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_intermixed_args(list(argv))
    recipe, overrides = "mesh_tangling_1k", []
    for item in args.overrides:
        if item.startswith("recipe="):
            recipe = item.split("=", 1)[1]
        else:
            overrides.append(item)
    if args.world_size < 1:
        print("plan-spatial: --world-size must be >= 1", file=sys.stderr)
        return 2
    if (args.alpha is None) != (args.beta is None):
        print("plan-spatial: give both --alpha and --beta, or neither (to calibrate)", file=sys.stderr)
        return 2
    import torch
    from hydra.utils import instantiate

    from lightning_hpc.perfmodel import AlphaBeta
    from lightning_hpc.spatial.planner import plan_for_model
    from lightning_hpc.spatial.planner.search import NoSingleSplitError

    torch.set_num_threads(max(args.threads, 1))
    try:
        cfg = load_recipe(recipe, overrides)
    except ValueError as e:
        print(f"plan-spatial: {e}", file=sys.stderr)
        return 2
    model = instantiate(cfg.model)
    input_shape = tuple(int(v) for v in cfg.input_shape)
    batch = args.batch_size or int(cfg.batch_size)
    ab = AlphaBeta(args.alpha, args.beta) if args.alpha is not None else None
    scale = max(1.0, args.world_size * args.threads / args.cores) if args.cores else 1.0
    restrict = (lambda d: d.spatial_size == 1) if args.sample_only else None
    print(f"plan-spatial: {recipe}, {args.world_size} processes: tracing the model"
          + ("" if ab is not None else ", calibrating alpha-beta between 2 local processes")
          + "; layer times are measured on this machine the first time (cached)", file=sys.stderr, flush=True)
    sync = None
    if args.loaded_sync:
        from lightning_hpc.perfmodel import calibrate_sync

        sync = calibrate_sync(args.world_size)
    def planned(uniform: bool):
        return plan_for_model(
            model, input_shape, args.world_size, batch, alpha_beta=ab, uniform=uniform, restrict=restrict,
            overlap_halo=args.overlap_halo, aggregate_bn=not args.local_bn, compute_scale=scale,
            gradient_reduction=args.gradient_reduction, sync=sync,
            progress=lambda line: print(f"plan-spatial: {line}", file=sys.stderr, flush=True),
        )

    try:
        try:
            plan = planned(uniform=not args.per_layer)
        except NoSingleSplitError:
            print("plan-spatial: no single split suits every layer of this model at this input size and world size "
                  "(SpatialParallelStrategy runs one split for all layers, so it cannot run this configuration: "
                  "use fewer processes per sample or a larger input); the per-layer plan follows",
                  file=sys.stderr, flush=True)
            plan = planned(uniform=False)
    except ValueError as e:
        print(f"plan-spatial: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"recipe": recipe, **plan.to_dict()}, indent=2))
    else:
        print(f"recipe {recipe}")
        print(plan.table())
        if len(input_shape) == 4 and any(p > 1 for p in plan.spatial_parts[:2]):
            print("advice: on CPUs a D or H split does not lower the peak memory per rank as a W split does (torch's "
                  "native 3-D convolution and its workspace take over from oneDNN on the thinner tile; measured in "
                  "docs/spatial.md): where memory is the reason to split, split W first")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

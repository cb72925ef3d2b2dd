"""Planner validation (Dryden et al. section V / VI-B3): predicted vs measured time per mini-batch.

Measured: the mesh FCN trained data-parallel (PyTorch DDP over gloo, one sample per process, SGD) on 1, 2 and 4
local processes, one torch thread each; the median step time over several steps (barrier to barrier).
Predicted: ``plan_for_model`` restricted to sample parallelism (the distribution that was run), with layer times
measured in this process, alpha-beta from the local gloo calibration, and compute scaled by processes / cores
by the measured slowdown of that many concurrent processes on this host
(``compute_contention``; ``--contention cores`` uses processes / cores instead), DDP's gradient buckets
(``gradient_reduction="bucketed"``), and the loaded synchronisation cost measured on P busy processes at the start
of the run (``calibrate_sync``, :mod:`lightning_hpc.perfmodel.sync`): every synchronisation point is charged
alpha-beta plus that measured extra.  ``predicted_ab_s`` is the same plan without the loaded term (alpha-beta only).

    python bench/mesh_planner.py [--size 256] [--convs 3] [--steps 6] [--rounds 2] [--spatial] [--worlds 1,2,4]

With ``--spatial`` (needs the spatial layers of ``lightning_hpc.spatial``), also pure spatial runs at
mini-batch 1 on 2 (2x1 tiles) and 4 (2x2) processes, predicted with the same distribution, halo overlap as run
(default off: one convolution over the tile + halo box), the box copies, and one fused gradient allreduce (what
``reduce_gradients`` does).  Every process runs one torch thread, and the layer times are taken with one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from harness import Report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_hpc.distributed import run_in_processes  # noqa: E402
from lightning_hpc.models import mesh_fcn  # noqa: E402
from lightning_hpc.perfmodel import LayerTimer, calibrate_local, calibrate_sync, compute_contention  # noqa: E402
from lightning_hpc.spatial.planner import plan_for_model  # noqa: E402


def _ddp_steps(rank: int, world_size: int, size: int, convs: int, steps: int, warmup: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(mesh_fcn(convs_per_block=convs))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 18, size, size, generator=g)
    y = (torch.rand(1, 1, size, size, generator=g) < 0.02).float()
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _spatial_steps(
    rank: int, world_size: int, size: int, convs: int, parts: tuple[int, int], overlap: bool, steps: int, warmup: int
) -> list[float]:
    """Hybrid sample x spatial training steps: the unchanged model on split activations (the op dispatch runs
    every op on its tile kernel), gradients reduced as the strategy reduces them."""
    from lightning_hpc.spatial.dispatch import split_tensor
    from lightning_hpc.spatial.dispatch.split_check import check_split
    from lightning_hpc.spatial.layout.gradients import reduce_model_gradients
    from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices

    layout = create_hybrid_layout(parts)
    torch.manual_seed(0)
    model = mesh_fcn(convs_per_block=convs)
    check_split(model, (18, size, size), parts)
    layout.grid.policy.overlap = overlap
    layout.grid.tile_params.clear()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(layout.sample_index)
    x = torch.randn(1, 18, size, size, generator=g)
    y = (torch.rand(1, 1, size, size, generator=g) < 0.02).float()
    rows, cols = tile_slices((size, size), parts, layout.grid.index)
    x = split_tensor(x[..., rows, cols].contiguous(), layout.grid, x.shape)
    y = split_tensor(y[..., rows, cols].contiguous(), layout.grid, y.shape)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        reduce_model_gradients(model, layout.num_sample_groups, layout.grid.tile_params)
        opt.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _scale(world: int, cores: int, how: str) -> float:
    """Compute slowdown of ``world`` ranks sharing this host: ``cores`` = processes / cores, ``measured`` = the
    measured contention (captures other jobs on a shared host)."""
    # 5 rounds of 5 convolutions (default 3 x 3): the factor multiplies all compute, so its noise matters
    return compute_contention(world, repeats=5, rounds=5) if how == "measured" else max(1.0, world / cores)


def _sync(world: int, args: argparse.Namespace, report: Report, cache: dict):
    """Loaded synchronisation cost of ``world`` busy processes, measured once per run (None: one process or
    ``--no-sync``)."""
    if world == 1 or args.no_sync:
        return None
    if world not in cache:
        cache[world] = calibrate_sync(world, use_cache=False)  # under the current load, like alpha-beta
        report.meta[f"loaded_sync_{world}"] = cache[world].to_dict()
        c = cache[world]
        print(
            f"loaded sync P={world}: chunk {1e3 * c.chunk_s:.2f} ms, allreduce {1e3 * c.allreduce_s:.3f} ms, "
            "all-gather "
            f"{1e3 * c.allgather_s:.3f} ms, sendrecv {1e3 * c.sendrecv_s:.3f} ms (idle "
            f"{1e3 * c.idle_allreduce_s:.3f} / "
            f"{1e3 * c.idle_allgather_s:.3f} / {1e3 * c.idle_sendrecv_s:.3f} ms), "
            f"{c.large_bytes >> 20} MiB allreduce {1e3 * c.large_allreduce_s:.2f} ms (overlapped "
            f"{1e3 * c.large_overlapped_s:.2f} ms)",
            flush=True,
        )
    return cache[world]


def _predict(world: int, batch: int, shape, args, ab, scale: float, sync, **kw) -> tuple[float, float, int]:
    """(predicted with the loaded sync term, predicted with alpha-beta only, sync points) from one set of layer
    times measured now."""
    with tempfile.TemporaryDirectory() as tmp:  # fresh layer times each round (same load as the run)
        timer = LayerTimer(cache_file=os.path.join(tmp, "times.json"), warmup=2, repeats=5)
        model = mesh_fcn(convs_per_block=args.convs)
        plan = plan_for_model(
            model, shape, world, batch_size=batch, alpha_beta=ab, timer=timer, compute_scale=scale, sync=sync, **kw
        )
        plain = plan_for_model(
            model, shape, world, batch_size=batch, alpha_beta=ab, timer=timer, compute_scale=scale, **kw
        )
    return plan.predicted_step_time, plain.predicted_step_time, plan.sync_points


def _spatial_rows(report: Report, args: argparse.Namespace, ab, cores: int, syncs: dict) -> None:
    """Measured vs predicted for pure spatial parallelism at mini-batch 1 (one distribution for every layer)."""
    shape = (18, args.size, args.size)
    for world, parts in ((2, (2, 1)), (4, (2, 2))):
        measured, predicted, plain, scales = [], [], [], []
        sync = _sync(world, args, report, syncs)
        want = (world // (parts[0] * parts[1]), *parts)
        for _ in range(args.rounds):
            times = run_in_processes(
                _spatial_steps,
                world,
                args.size,
                args.convs,
                parts,
                args.overlap,
                args.steps,
                args.warmup,
                timeout_s=1500,
                collective_timeout_s=600,
            )[0]
            measured.append(statistics.median(times))
            scale = _scale(world, cores, args.contention)
            scales.append(scale)
            pred, pred_ab, points = _predict(
                world,
                1,
                shape,
                args,
                ab,
                scale,
                sync,
                restrict=lambda d: (d.n, d.h, d.w) == want,
                gradient_reduction="single",
                overlap_halo=args.overlap,
            )
            predicted.append(pred)
            plain.append(pred_ab)
        _row(report, world, 1, f"N1 x H{parts[0]} x W{parts[1]} (spatial)", measured, predicted, plain, scales, points)


def _row(report: Report, world: int, batch: int, label: str, measured, predicted, plain, scales, points: int) -> None:
    meas, pred, pred_ab = statistics.median(measured), statistics.median(predicted), statistics.median(plain)
    report.add(processes=world, mini_batch=batch, distribution=label, measured_s=meas, predicted_s=pred,
               error_pct=100 * (pred - meas) / meas, predicted_ab_s=pred_ab, error_ab_pct=100 * (pred_ab - meas) / meas,
               sync_points=points, measured_rounds=[round(m, 4) for m in measured],
               predicted_rounds=[round(p, 4) for p in predicted], compute_scale=statistics.median(scales))
    print(
        f"{label} P={world}: measured {meas:.3f}s predicted {pred:.3f}s ({100 * (pred - meas) / meas:+.1f}%; "
        "alpha-beta only "
        f"{pred_ab:.3f}s, {100 * (pred_ab - meas) / meas:+.1f}%), {points} sync points",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--convs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="repeat measure + predict, report medians")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--contention", choices=("measured", "cores"), default="measured",
                    help="compute slowdown of concurrent ranks: measured (compute_contention) or processes / cores")
    ap.add_argument("--spatial", action="store_true", help="also measure spatial runs (needs the spatial layers)")
    ap.add_argument("--no-sync", action="store_true", help="skip the loaded-sync calibration (alpha-beta model only)")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="spatial runs with the interior/halo overlap of section IV-A "
        "(default: one convolution over the tile + halo box, the faster path on CPU)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    ab = calibrate_local(2, use_cache=False)  # under the current load of the host
    shape = (18, args.size, args.size)
    report = Report("mesh_planner")
    syncs: dict = {}
    report.meta.update(
        size=args.size,
        convs=args.convs,
        alpha=ab.alpha,
        beta=ab.beta,
        cores=cores,
        note="2-core machine, run under the exclusive benchmark lock; one torch thread per process",
        loadavg_start=os.getloadavg(),
    )
    for world in [int(w) for w in args.worlds.split(",")]:
        measured, predicted, plain, scales = [], [], [], []
        sync = _sync(world, args, report, syncs)
        for _ in range(args.rounds):
            times = run_in_processes(
                _ddp_steps,
                world,
                args.size,
                args.convs,
                args.steps,
                args.warmup,
                timeout_s=1500,
                collective_timeout_s=600,
            )[0]
            measured.append(statistics.median(times))
            scale = _scale(world, cores, args.contention)
            scales.append(scale)
            pred, pred_ab, points = _predict(
                world,
                world,
                shape,
                args,
                ab,
                scale,
                sync,
                restrict=lambda d: d.h == 1 and d.w == 1,
                gradient_reduction="bucketed",
            )
            predicted.append(pred)
            plain.append(pred_ab)
        _row(report, world, world, f"N{world} x H1 x W1 (DDP)", measured, predicted, plain, scales, points)
    if args.spatial:
        _spatial_rows(report, args, ab, cores, syncs)
    report.print(
        [
            "processes",
            "distribution",
            "measured_s",
            "predicted_s",
            "error_pct",
            "predicted_ab_s",
            "error_ab_pct",
            "sync_points",
        ]
    )
    report.write()
    report.plot_bars(
        "distribution",
        "error_pct",
        title=f"planner error, mesh FCN 18x{args.size}^2 (DDP, CPU gloo)",
        ylabel="(predicted - measured) / measured %",
    )


if __name__ == "__main__":
    main()

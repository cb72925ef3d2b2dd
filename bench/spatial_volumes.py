"""Spatial parallelism on volumes (Dryden et al., section I: 3-D, surface-to-volume), on this machine's CPU/gloo.

One training step (forward, mean BCE loss, backward) of the 3-D U-Net of ``recipe=volumes_unet3d``
(``lightning_hpc.models.unet``) on ONE volume of ``size^3`` voxels, through the op dispatch as the strategy runs
a user's module (split input and target, an unchanged mean loss), on 1, 2 and 4 processes (splits 1x1x1, 2x1x1,
2x2x1; one torch thread per process).  Per configuration:

* peak memory per rank: the CPU allocator's peak of tensor bytes during the step plus the tensors held before it
  (``bench/spatial.py``'s measure: what a GPU user reads from ``max_memory_allocated``), as a ratio of the
  single-process run;
* halo bytes per step, counted at the exchange (every point-to-point message of the step through
  ``lightning_hpc.distributed.p2p.exchange``, summed over ranks) beside the window arithmetic's prediction
  (:func:`lightning_hpc.spatial.dispatch.windows.halo_elements` of every windowed layer at its traced shape, forward and
  backward);
* step time (median of ``--repeats`` steps after one warm-up) beside the planner's prediction for that split
  (``plan_for_model`` with ``uniform=True``, restricted to the split, as ``bench/mesh_planner.py`` predicts on
  this host: layer times measured in the run, the measured compute contention of the processes sharing the cores,
  the loaded synchronisation term; also alpha-beta only).

``--loss dicece`` trains the segmentation a MONAI user writes instead: the U-Net with a ``Dropout3d`` before its
head, 2 classes, the label one-hot encoded by ``scatter_`` into a ``zeros_like`` of the logits (MONAI's
``one_hot``) and a Dice + cross-entropy loss (MONAI's ``DiceCELoss``: soft Dice over the voxels per class,
``squeeze`` of the label for the cross-entropy); the ``gathers`` column then shows that none of it is gathered.

Run alone on the machine (e.g. under ``flock`` on a lock file other benchmarks take too):
      python bench/spatial_volumes.py [--size 64] [--widths 8 16 32] [--repeats 3] [--splits 1x1x1 2x1x1 1x1x2]
                                      [--loss bce|dicece]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report  # noqa: E402
from spatial import _allocator_peak  # noqa: E402

from lightning_hpc.distributed import p2p, run_in_processes  # noqa: E402
from lightning_hpc.models.unet import unet  # noqa: E402
from lightning_hpc.spatial.dispatch import split_tensor, state  # noqa: E402
from lightning_hpc.spatial.dispatch.split_check import trace_shapes  # noqa: E402
from lightning_hpc.spatial.dispatch.windows import layer_windows, tile_halo_blocks  # noqa: E402
from lightning_hpc.spatial.layout.gradients import reduce_gradients  # noqa: E402
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout  # noqa: E402

SPLITS = ("1x1x1", "2x1x1", "2x2x1")


def predicted_halo_bytes(widths: list[int], size: int, parts: tuple[int, ...]) -> int:
    """Bytes every rank together receives per step by the window arithmetic: for each windowed layer, every
    tile's received blocks (faces, edges, corners) times the channels and 4 bytes, forward and backward (the
    network's input exchanges in forward only: it needs no gradient)."""
    model = unet(1, 1, widths)
    shapes = trace_shapes(model, (1, size, size, size))
    first = next(iter(shapes))  # the layer that reads the network's input
    total = 0
    for name, (in_shape, out_shape) in shapes.items():
        windows = layer_windows(model.get_submodule(name), in_shape, out_shape)
        if windows is None or any(n < p for n, p in zip(in_shape[2:], parts)):
            continue
        received = sum(map(sum, tile_halo_blocks(windows, in_shape[2:], parts).values()))
        directions = 1 if name == first else 2
        total += directions * received * in_shape[1] * 4
    return total


def dice_ce(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """MONAI's ``DiceCELoss(softmax=True, to_onehot_y=True)`` on ``N x C x D x H x W`` logits and an ``N x 1 x ...``
    integer label, written as MONAI writes it (``one_hot`` by ``scatter_`` into zeros, soft Dice per class over the
    voxels, cross-entropy on the squeezed label)."""
    onehot = torch.zeros_like(logits).scatter_(1, label, 1.0)
    probs = logits.softmax(1)
    dims = tuple(range(2, logits.dim()))
    intersection = (probs * onehot).sum(dims)
    denominator = probs.sum(dims) + onehot.sum(dims)
    dice = 1.0 - (2.0 * intersection + 1e-5) / (denominator + 1e-5)
    return dice.mean() + F.cross_entropy(logits, label.squeeze(1))


def _worker(rank: int, world: int, parts, size: int, widths: list[int], repeats: int, loss_kind: str = "bce"):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    grid = create_hybrid_layout(parts).grid
    if loss_kind == "dicece":
        net = unet(1, 2, widths)
        net.head = torch.nn.Sequential(torch.nn.Dropout3d(0.2), net.head)  # dropout before the head, as users add it
        model: torch.nn.Module = net
    else:
        model = unet(1, 1, widths)
    cut = grid.tile_bounds(size, size, size)
    shape = tuple(b - a for a, b in cut)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, *shape, generator=g)  # each rank creates only its own sub-volume
    if loss_kind == "dicece":
        y = (torch.rand(1, 1, *shape, generator=g) > 0.9).long()
    else:
        y = (torch.rand(1, 1, *shape, generator=g) > 0.9).float()
    params = list(model.parameters())
    held = sum(t.numel() * t.element_size() for t in (x, y, *params, *model.buffers()))
    sent = [0]
    original = p2p.exchange
    # every module that posts point-to-point messages imported the one exchange function by name
    users = [m for name, m in sys.modules.items() if name.startswith("lightning_hpc.")
             and getattr(m, "exchange", None) is original]

    def counting(sends, recvs, group):
        sent[0] += sum(buf.numel() * buf.element_size() for buf, _, _ in sends)
        return original(sends, recvs, group)

    def step() -> None:
        xs = split_tensor(x, grid, (1, 1, size, size, size))
        ys = split_tensor(y, grid, (1, 1, size, size, size))
        out = model(xs)
        loss = dice_ce(out, ys) if loss_kind == "dicece" else F.binary_cross_entropy_with_logits(out, ys)
        loss.backward()
        tile = [p for p in params if id(p) in grid.tile_params]
        reduce_gradients(tile, [p for p in params if id(p) not in grid.tile_params], 1)
        for p in params:
            p.grad = None

    step()  # warm-up (plans, caches)
    if dist.is_initialized():
        dist.barrier()
    for m in users:
        m.exchange = counting
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        for m in users:
            m.exchange = original
    alloc_peak, _ = _allocator_peak(prof, f"/tmp/spatial_volumes_{os.getpid()}.json")
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"alloc_peak_MiB": (held + alloc_peak) / 2**20, "sent_bytes": sent[0], "step_s": statistics.median(times),
            "gathers": state().gathers}


def _predict(parts: tuple[int, ...], args: argparse.Namespace, ab) -> dict[str, float]:
    """The planner's step time for this split (``uniform``, restricted to it), as ``bench/mesh_planner.py``
    predicts on this host: layer times measured now (a fresh cache: the same load as the run), compute scaled by
    the measured slowdown of ``procs`` one-thread processes sharing the cores (``compute_contention``), one fused
    gradient allreduce (what the step does), and the loaded synchronisation cost of ``procs`` busy processes
    (``calibrate_sync``); also the same plan with alpha-beta only."""
    import tempfile

    from lightning_hpc.perfmodel import LayerTimer, calibrate_sync, compute_contention
    from lightning_hpc.spatial.planner import plan_for_model

    procs = prod(parts)
    scale = compute_contention(procs, repeats=5, rounds=5)
    sync = calibrate_sync(procs, use_cache=False) if procs > 1 else None
    out = {"compute_scale": scale}
    torch.set_num_threads(1)  # the layer times of one-thread ranks
    with tempfile.TemporaryDirectory() as tmp:
        timer = LayerTimer(cache_file=os.path.join(tmp, "times.json"))
        for key, s in (("step_s_predicted", sync), ("step_s_predicted_ab", None)):
            plan = plan_for_model(unet(1, 1, args.widths), (1, args.size, args.size, args.size), procs, 1,
                                  alpha_beta=ab, timer=timer, uniform=True, compute_scale=scale, sync=s,
                                  gradient_reduction="single", restrict=lambda d: d.parts(3) == parts)
            out[key] = plan.predicted_step_time
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64, help="voxels per side of the volume")
    ap.add_argument("--widths", type=int, nargs="+", default=[8, 16, 32], help="U-Net widths per level")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-plan", action="store_true", help="skip the planner's predictions (no calibration)")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), help="D x H x W splits; the first is the baseline "
                    "of the memory ratio (default: %(default)s)")
    ap.add_argument("--tag", default="", help="suffix of the result files (bench/results/spatial_volumes<tag>.*)")
    ap.add_argument("--loss", choices=["bce", "dicece"], default="bce",
                    help="dicece: a Dropout3d U-Net with MONAI-style one-hot + Dice-CE (see the module docstring)")
    args = ap.parse_args(argv)
    splits = [tuple(int(p) for p in s.split("x")) for s in args.splits]
    report = Report(f"spatial_volumes{args.tag}", meta={"size": args.size, "widths": args.widths, "loss": args.loss,
                                             "loadavg_start": os.getloadavg(), "note": "gloo, 1 thread per rank"})
    ab = None
    if not args.no_plan:
        from lightning_hpc.perfmodel import calibrate_local

        ab = calibrate_local(2)
    for parts in splits:
        procs = prod(parts)
        res = run_in_processes(_worker, procs, parts, args.size, args.widths, args.repeats, args.loss, timeout_s=1800,
                               collective_timeout_s=900)
        row = report.add(
            procs=procs, split="x".join(map(str, parts)),
            alloc_peak_MiB=max(r["alloc_peak_MiB"] for r in res),
            halo_bytes_measured=sum(r["sent_bytes"] for r in res),
            halo_bytes_predicted=predicted_halo_bytes(args.widths, args.size, parts),
            step_s=max(r["step_s"] for r in res), gathers=max(r["gathers"] for r in res),
        )
        if ab is not None:
            row.update(_predict(parts, args, ab))
            row["predicted_vs_measured"] = row["step_s_predicted"] / row["step_s"]
            row["predicted_ab_vs_measured"] = row["step_s_predicted_ab"] / row["step_s"]
        print(row, flush=True)
    report.add_ratios("split", "alloc_peak_MiB", args.splits[0], "memory_vs_baseline")
    report.meta["loadavg_end"] = os.getloadavg()
    report.print()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

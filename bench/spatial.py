"""Spatial parallelism benchmarks (Dryden et al., Tables I/II and section IV-A), on this machine's CPU/gloo.

1. memory:  peak memory per rank for ONE 2048 x 2048 x 18 sample through the 2K mesh model (forward +
            backward) on 1, 2 and 4 processes (tiles 1x1, 2x1, 2x2).  Reported two ways: the bytes autograd
            holds for backward (exact, from saved-tensor hooks) and the peak RSS growth of the process during
            the step (what the OS saw).
2. scaling: strong scaling of the 1K mesh model (one training step: forward, per-pixel loss, backward,
            gradient reduction, SGD) at mini-batch N = 1 and 2 on 1 and 2 processes, Table I style:
            "1 proc/sample" (N = 1: one process; N = 2: sample parallel over 2 processes, or one process) and
            "2 procs/sample" (spatial 2x1).  Medians of repeated steps.
3. overlap: the same 1K step on 2 processes with the halo exchange overlapped with the interior convolution
            and without, alternating step by step in the same processes.

The mesh models follow section VI: six blocks of three (1K) or five (2K) conv-BN-ReLU with 3x3 filters,
stride 2 at the first conv of each block, a final 1x1 prediction conv and upsampling to the input resolution.
lightning_hpc.models.mesh_fcn (written on another branch) was not in this worktree when the bench was
written, so the architecture is defined here; the channel widths (16, 32, 64, 64, 128, 128) are ours (the
paper does not give them).

Run:  python bench/spatial.py            (all three; ~15-20 min on a shared 2-core machine)
      python bench/spatial.py --only memory|scaling|overlap  [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Report  # noqa: E402

from lightning_hpc.distributed import run_in_processes  # noqa: E402
from lightning_hpc.distributed.partition import block_range  # noqa: E402
from lightning_hpc.strategies.spatial.convert import convert_model, split_parameters  # noqa: E402
from lightning_hpc.strategies.spatial.gradients import reduce_gradients  # noqa: E402
from lightning_hpc.strategies.spatial.tiling import create_hybrid_layout  # noqa: E402

WIDTHS = (16, 32, 64, 64, 128, 128)


def mesh_fcn(convs_per_block: int, in_channels: int = 18, widths=WIDTHS) -> nn.Sequential:
    """Section VI's FCN: 6 blocks of ``convs_per_block`` conv-BN-ReLU (stride 2 first), 1x1 prediction, upsample."""
    layers: list[nn.Module] = []
    cin = in_channels
    for width in widths:
        for k in range(convs_per_block):
            layers += [nn.Conv2d(cin, width, 3, stride=2 if k == 0 else 1, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            cin = width
    layers += [nn.Conv2d(cin, 1, 1), nn.Upsample(scale_factor=2 ** len(widths), mode="bilinear")]
    return nn.Sequential(*layers)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_worker(rank: int, world: int, parts, size: int, convs: int):
    torch.manual_seed(0)
    layout = create_hybrid_layout(parts)
    grid = layout.grid
    model = convert_model(mesh_fcn(convs), grid, input_shape=(18, size, size))
    # each rank creates only its own tile (as the tile reader does): no rank ever holds the whole sample
    (h0, h1), (w0, w1) = grid.tile_bounds(size, size)
    x = torch.randn(1, 18, h1 - h0, w1 - w0)
    y = (torch.rand(1, 1, h1 - h0, w1 - w0) > 0.5).float()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if dist.is_initialized():
        dist.barrier()
    before = _rss_bytes()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.binary_cross_entropy_with_logits(model(x), y, reduction="sum") / float(size * size)
    saved_bytes = sum(saved.values())
    loss.backward()
    step = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"saved_MiB": saved_bytes / 2**20, "rss_growth_MiB": (peak - before) / 2**20, "input_tile_MiB": x.numel() * 4 / 2**20, "step_s": step}


def bench_memory(report: Report, size: int = 2048) -> None:
    for procs, parts in ((1, (1, 1)), (2, (2, 1)), (4, (2, 2))):
        res = run_in_processes(_memory_worker, procs, parts, size, 5, timeout_s=1800, collective_timeout_s=900)
        worst = max(res, key=lambda r: r["saved_MiB"])
        report.add(
            bench="memory_2k", procs=procs, tiles=f"{parts[0]}x{parts[1]}",
            saved_MiB_max_rank=worst["saved_MiB"],
            rss_growth_MiB_max_rank=max(r["rss_growth_MiB"] for r in res),
            input_tile_MiB=worst["input_tile_MiB"], step_s=max(r["step_s"] for r in res),
        )
        print(report.rows[-1], flush=True)
    base = report.rows[-3]
    for row in report.rows[-3:]:
        row["saved_vs_1proc"] = row["saved_MiB_max_rank"] / base["saved_MiB_max_rank"]
        row["rss_vs_1proc"] = row["rss_growth_MiB_max_rank"] / base["rss_growth_MiB_max_rank"]


def _train_worker(rank: int, world: int, parts, batch: int, size: int, overlap, repeats: int):
    """Median-able step times; ``overlap="alternate"`` toggles the halo overlap of every conv between steps
    (same process, same weights, so the comparison sees the same machine load)."""
    torch.manual_seed(0)
    layout = create_hybrid_layout(parts)
    grid = layout.grid
    model = convert_model(mesh_fcn(3), grid, overlap=overlap is not False, input_shape=(18, size, size))
    convs = [m for m in model.modules() if hasattr(m, "overlap")]
    tile_p, rep_p = split_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s0, s1 = block_range(batch, layout.num_sample_groups, layout.sample_index)
    (h0, h1), (w0, w1) = grid.tile_bounds(size, size)
    g = torch.Generator().manual_seed(layout.sample_index)
    x = torch.randn(s1 - s0, 18, h1 - h0, w1 - w0, generator=g)
    y = (torch.rand(s1 - s0, 1, h1 - h0, w1 - w0, generator=g) > 0.5).float()
    pixels = float((s1 - s0) * size * size)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(x), y, reduction="sum") / pixels
        loss.backward()
        reduce_gradients(tile_p, rep_p, layout.num_sample_groups)
        opt.step()

    times: dict[bool, list[float]] = {True: [], False: []}
    modes = [True, False] if overlap == "alternate" else [bool(overlap)]
    step()  # warm-up
    for k in range(repeats * len(modes)):
        mode = modes[k % len(modes)]
        for m in convs:
            m.overlap = mode
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step()
        if dist.is_initialized():
            dist.barrier()
        times[mode].append(time.perf_counter() - t0)
    return times if overlap == "alternate" else times[bool(overlap)]


def _steps(procs: int, parts, batch: int, size: int, overlap, repeats: int):
    return run_in_processes(_train_worker, procs, parts, batch, size, overlap, repeats, timeout_s=1800, collective_timeout_s=900)[0]


def bench_scaling(report: Report, repeats: int, size: int = 1024, rounds: int = 3) -> None:
    """Configurations are interleaved round by round (the machine's load drifts); medians over all steps."""
    configs = {
        1: [("1 proc", 1, (1, 1)), ("2 procs, 2 procs/sample (spatial 2x1)", 2, (2, 1))],
        2: [("1 proc", 1, (1, 1)), ("2 procs, 1 proc/sample (sample parallel)", 2, (1, 1)),
            ("2 procs, 2 procs/sample (spatial 2x1)", 2, (2, 1))],
    }
    samples: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for batch, entries in configs.items():
            for name, procs, parts in entries:
                samples.setdefault((batch, name), []).extend(_steps(procs, parts, batch, size, True, repeats))
    for batch, entries in configs.items():
        t1 = statistics.median(samples[(batch, "1 proc")])
        for name, procs, _ in entries:
            ts = samples[(batch, name)]
            report.add(bench="scaling_1k", N=batch, config=name, procs=procs, step_s=statistics.median(ts),
                       step_s_min=min(ts), steps=len(ts), speedup_vs_1proc=t1 / statistics.median(ts))
    print(report.rows, flush=True)


def bench_overlap(report: Report, repeats: int, size: int = 1024) -> None:
    times = _steps(2, (2, 1), 1, size, "alternate", repeats)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    report.add(bench="overlap_1k", N=1, config="spatial 2x1, overlap on", procs=2, step_s=on, step_s_min=min(times[True]),
               steps=len(times[True]), speedup_vs_off=off / on)
    report.add(bench="overlap_1k", N=1, config="spatial 2x1, overlap off", procs=2, step_s=off, step_s_min=min(times[False]),
               steps=len(times[False]), speedup_vs_off=1.0)
    print(report.rows[-2:], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["memory", "scaling", "overlap"], action="append")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per process group (after 1 warm-up)")
    ap.add_argument("--size-2k", type=int, default=2048)
    ap.add_argument("--size-1k", type=int, default=1024)
    args = ap.parse_args(argv)
    which = args.only or ["memory", "scaling", "overlap"]
    for name in which:
        report = Report(f"spatial_{name}", meta={"note": "2 CPU cores shared with other jobs; gloo; 1 thread per rank",
                                                    "widths": WIDTHS})
        if name == "memory":
            bench_memory(report, args.size_2k)
        elif name == "scaling":
            bench_scaling(report, args.repeats, args.size_1k)
        else:
            bench_overlap(report, args.repeats, args.size_1k)
        report.print()
        report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Mesh-tangling generator speed and label statistics per sample size (one thread, one process).

    python bench/mesh_generator.py [--sizes 256,512,1024,2048] [--samples 2]

With ``--workers 1,4``, instead: the wall time of ``lightning-hpc mesh-data --workers N`` (one thread a worker) for
each N on the same data set (``--samples`` samples of ``--sizes``' first size, each N into its own temporary folder,
the N in the order given, then again in the reverse order; the best of the two), and each against the first N:

    python bench/mesh_generator.py --workers 1,4 --sizes 1024 --samples 16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from harness import Report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_hpc.data.mesh_tangling import TARGET, generate_sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,512,1024,2048")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--workers", default=None, help="worker counts of mesh-data to time against the first (1,4)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.workers:
        time_workers(int(args.sizes.split(",")[0]), args.samples, [int(w) for w in args.workers.split(",")], args.tag)
        return
    torch.set_num_threads(1)
    report = Report("mesh_generator")
    report.meta.update(note="2-core machine shared with other jobs, 1 torch thread; medians over samples")
    for size in [int(s) for s in args.sizes.split(",")]:
        times, positives = [], []
        for index in range(args.samples):
            t0 = time.perf_counter()
            sample = generate_sample(0, index, size)
            times.append(time.perf_counter() - t0)
            positives.append(float(sample[TARGET].mean()))
        times.sort()
        row = report.add(
            size=size,
            seconds_per_sample=times[len(times) // 2],
            min_s=times[0],
            mask_positive_pct=100 * sum(positives) / len(positives),
        )
        print(row, flush=True)
    report.print()
    report.write()
    report.plot_bars(
        "size", "seconds_per_sample", title="mesh-tangling generator (1 thread, shared host)", ylabel="s / sample"
    )


def time_workers(size: int, samples: int, workers: list[int], tag: str) -> None:
    """Wall seconds of ``mesh-data --workers N`` for each N of ``workers`` (module docstring)."""
    from lightning_hpc.data.mesh_tangling.cli import main as mesh_data

    best: dict[int, float] = {}
    for order in (workers, workers[::-1]):
        for n in order:
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                rc = mesh_data(["--size", str(size), "--samples", str(samples), "--out", out, "--workers", str(n),
                                "--quiet"])
                elapsed = time.perf_counter() - t0
            if rc != 0:
                raise SystemExit(f"mesh-data --workers {n} exited {rc}")
            best[n] = min(best.get(n, elapsed), elapsed)
    report = Report(f"mesh_data_workers{tag}")
    report.meta.update(size=size, samples=samples, cpus=os.cpu_count(), threads_per_worker=1)
    for n in workers:
        report.add(workers=n, wall_s=best[n], seconds_per_sample=best[n] / samples,
                   speedup_vs_first=best[workers[0]] / best[n])
    report.print()
    report.write()


if __name__ == "__main__":
    main()

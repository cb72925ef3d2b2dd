"""Mesh-tangling generator speed and label statistics per sample size (one thread, one process).

    python bench/mesh_generator.py [--sizes 256,512,1024,2048] [--samples 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from harness import Report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_hpc.data.mesh_tangling import TARGET, generate_sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,512,1024,2048")
    ap.add_argument("--samples", type=int, default=2)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()

"""Per-call cost of the N-d convolution kernel against the 2-D layer, same run (a ratio, not a figure).

On a 2x1 spatial grid (2 processes, gloo, one torch thread each) a 3x3 / padding 1 convolution of a
``N x C x H x W`` float32 sample (default 1 x 64 x 128 x 128, 64 output channels, stride 1) is timed forward + backward
through :func:`lightning_hpc.spatial.kernels.conv` (the plain function: tile check, cached halo plan,
in-place tile path) and through :class:`lightning_hpc.spatial.conv.SpatialConv2d` (the layer: its own cached plan
and edge regions), alternating call by call in the same processes, so that the machine's load hits both alike.
Prints the median seconds of each and their ratio (kernel / layer; 1.0 means no per-call overhead).

``--baseline-rev REV`` times the layer as ``lightning_hpc/spatial/conv.py`` of git revision ``REV`` defines it
(loaded from ``git show``, on this tree's halo exchange), e.g. the 2-D layer before it ran on the N-d kernel.

      python bench/spatial_kernels.py [--channels 64] [--size 128] [--stride 1] [--calls 20] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import types

import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial import kernels as K
from lightning_hpc.spatial.conv import SpatialConv2d
from lightning_hpc.spatial.tiling import create_hybrid_layout, tile_slices


def _layer_class(source: str | None) -> type:
    """SpatialConv2d, or the one ``source`` (a revision's conv.py) defines."""
    if source is None:
        return SpatialConv2d
    module = types.ModuleType("baseline_conv")
    exec(compile(source, "baseline_conv.py", "exec"), module.__dict__)  # noqa: S102 - a revision of this repository
    return module.SpatialConv2d


def _worker(rank: int, world: int, channels: int, size: int, calls: int, stride: int,
            source: str | None) -> dict[str, float]:
    torch.set_num_threads(1)
    grid = create_hybrid_layout((2, 1)).grid
    conv = nn.Conv2d(channels, channels, 3, stride=stride, padding=1)
    layer = _layer_class(source).from_module(conv, grid)
    x = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(0))
    tile = x[(Ellipsis, *tile_slices((size, size), grid.parts, grid.index))].contiguous().requires_grad_(True)

    def kernel() -> torch.Tensor:
        return K.conv(tile, conv.weight, conv.bias, grid, (size, size), stride=stride, padding=1)

    def module() -> torch.Tensor:
        return layer.tile_call(tile, (size, size))

    times: dict[str, list[float]] = {"kernel": [], "layer": []}
    for i in range(calls + 2):
        for name, fn in (("kernel", kernel), ("layer", module)) if i % 2 else (("layer", module), ("kernel", kernel)):
            torch.distributed.barrier(group=grid.group)
            t0 = time.perf_counter()
            fn().sum().backward()
            dt = time.perf_counter() - t0
            if i >= 2:  # the first calls warm the plan caches and the allocator
                times[name].append(dt)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--stride", type=int, default=1, help="2 with an odd tile height (e.g. --size 130) takes the box "
                                                         "path, 1 the in-place tile path")
    ap.add_argument("--baseline-rev", default=None, help="time the layer of this git revision's conv.py")
    args = ap.parse_args(argv)
    source = None
    if args.baseline_rev:
        source = subprocess.run(["git", "show", f"{args.baseline_rev}:lightning_hpc/spatial/conv.py"], check=True,
                                capture_output=True, text=True).stdout
    results = run_in_processes(_worker, 2, args.channels, args.size, args.calls, args.stride, source,
                               timeout_s=900)
    kernel = max(r["kernel"] for r in results)
    layer = max(r["layer"] for r in results)
    print(json.dumps({"grid": "2x1", "channels": args.channels, "size": args.size, "stride": args.stride,
                      "layer": args.baseline_rev or "HEAD",
                      "kernel_s": kernel, "layer_s": layer, "ratio_kernel_over_layer": kernel / layer}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-call cost of the op dispatch: a plain ``nn.Conv2d`` on a split activation against the convolution kernel it
dispatches to, same run (a ratio, not a figure).

On a 2x1 spatial grid (2 processes, gloo, one torch thread each) a 3x3 / padding 1 convolution of a
``N x C x H x W`` float32 sample (default 1 x 64 x 128 x 128, 64 output channels, stride 1) is timed forward + backward
through :func:`lightning_hpc.spatial.kernels.conv` (the plain function: tile check, cached halo plan, in-place tile
path) and through the unchanged layer called on a :class:`~lightning_hpc.spatial.dispatch.SpatialTensor` (the
``__torch_function__`` route, its handler and the same kernel), alternating call by call in the same processes, so
that the machine's load hits both alike.  Prints the median seconds of each and their ratio (dispatch / kernel;
1.0 means no per-call overhead).  The dispatch's own per-op Python work is checked in
tests/spatial/dispatch/test_dispatch_overhead.py.

      python bench/spatial_kernels.py [--channels 64] [--size 128] [--stride 1] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial import kernels as K
from lightning_hpc.spatial.dispatch import split_tensor
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices


def _worker(rank: int, world: int, channels: int, size: int, calls: int, stride: int) -> dict[str, float]:
    torch.set_num_threads(1)
    grid = create_hybrid_layout((2, 1)).grid
    conv = nn.Conv2d(channels, channels, 3, stride=stride, padding=1)
    x = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(0))
    tile = x[(Ellipsis, *tile_slices((size, size), grid.parts, grid.index))].contiguous().requires_grad_(True)

    def kernel() -> torch.Tensor:
        return K.conv(tile, conv.weight, conv.bias, grid, (size, size), stride=stride, padding=1)

    def dispatched() -> torch.Tensor:
        return conv(split_tensor(tile, grid, x.shape)).local()

    times: dict[str, list[float]] = {"kernel": [], "dispatch": []}
    order = (("kernel", kernel), ("dispatch", dispatched))
    for i in range(calls + 2):
        for name, fn in order if i % 2 else order[::-1]:
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
    args = ap.parse_args(argv)
    results = run_in_processes(_worker, 2, args.channels, args.size, args.calls, args.stride, timeout_s=900)
    kernel = max(r["kernel"] for r in results)
    dispatch = max(r["dispatch"] for r in results)
    print(json.dumps({"grid": "2x1", "channels": args.channels, "size": args.size, "stride": args.stride,
                      "kernel_s": kernel, "dispatch_s": dispatch, "ratio_dispatch_over_kernel": dispatch / kernel}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``torch.compile`` of a split model: a training step of the mesh-tangling FCN (18 channels, 3 convolutions per
block) on a split activation over ONE tile, compiled (:mod:`lightning_hpc.spatial.compile`: the forward one graph of
tile operations, compiled by inductor) against the same model compiled on plain tensors, and both eager, alternated
step by step in one process.  Also reports the dynamo graphs and the traces of the split forward (1 and 1: no graph
break, the program replayed on every later step).

    python bench/spatial_compiled.py [--sizes 128 256] [--repeats 15] [--backend inductor] [--tag _2026_11_29]

One torch thread; run it alone on the machine (step times taken beside other work are not figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Report  # noqa: E402

from lightning_hpc.models import mesh_fcn  # noqa: E402
from lightning_hpc.spatial.compile import SplitCompiledForward  # noqa: E402
from lightning_hpc.spatial.dispatch import split_tensor  # noqa: E402
from lightning_hpc.spatial.layout.tiling import SpatialGrid  # noqa: E402

KINDS = ("plain", "split", "plain_compiled", "split_compiled")


def steps(size: int, backend: str) -> tuple[dict[str, Callable[[], None]], SplitCompiledForward]:
    """One SGD step of each kind (same model, same data); the split compiled forward, for its counters."""
    torch.manual_seed(0)
    net = mesh_fcn(in_channels=18, convs_per_block=3)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # lr 0: every kind steps the same model
    x = torch.randn(1, 18, size, size)
    y = (torch.rand(1, 1, size, size) > 0.5).float()
    grid = SpatialGrid.single()
    compiled = torch.compile(net, backend=backend)
    split_compiled = SplitCompiledForward(torch.compile(net, backend=backend))

    def make(forward: Callable[[torch.Tensor], torch.Tensor], split: bool) -> Callable[[], None]:
        def step() -> None:
            xs = split_tensor(x, grid, tuple(x.shape)) if split else x
            ys = split_tensor(y, grid, tuple(y.shape)) if split else y
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(forward(xs), ys).backward()
            opt.step()

        return step

    return {"plain": make(net, False), "split": make(net, True), "plain_compiled": make(compiled, False),
            "split_compiled": make(split_compiled, True)}, split_compiled


def measure(size: int, repeats: int, backend: str) -> dict[str, float | int | str | None]:
    kinds, split_compiled = steps(size, backend)
    for _ in range(3):  # warm-up: compiles and traces
        for step in kinds.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(repeats):
        for k in (KINDS if r % 2 else tuple(reversed(KINDS))):
            t0 = time.perf_counter()
            kinds[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": size, **{f"{k}_ms": med[k] * 1e3 for k in KINDS},
            "split_over_plain": med["split"] / med["plain"],
            "compiled_split_over_compiled_plain": med["split_compiled"] / med["plain_compiled"],
            "compiled_split_over_eager_split": med["split_compiled"] / med["split"],
            "graphs": split_compiled.graphs, "traces": split_compiled.traces, "refused": split_compiled.refused}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--repeats", type=int, default=15, help="timed steps of each kind per size")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of both compiled kinds")
    ap.add_argument("--tag", default="", help="suffix of the result files (bench/results/spatial_compiled<tag>.*)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = Report(f"spatial_compiled{args.tag}")
    for size in args.sizes:
        report.add(**measure(size, args.repeats, args.backend))
        report.print()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

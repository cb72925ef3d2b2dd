"""``torch.compile`` of a split model: a training step of the mesh-tangling FCN (18 channels, 3 convolutions per
block) on a split activation over ONE tile, compiled (:mod:`lightning_hpc.spatial.compile`: the forward one graph of
tile operations, compiled by inductor) against the same model compiled on plain tensors, and both eager, alternated
step by step in one process.  Also reports the dynamo graphs and the traces of the split forward (1 and 1: no graph
break, the program replayed on every later step).

With ``--kfac``, every kind trains its own copy of the model under K-FAC (``KFACPreconditioner`` at its defaults:
factors every 10 steps, decompositions every 100; the split kinds with the tiled handlers the spatial strategy
gives K-FAC, through a registry of the tiled layers over the one tile), and the kinds alternate by blocks of 10
steps (one factor-update step each): the amortized step.  Both compiled kinds take K-FAC's route for compiled
modules (:mod:`lightning_hpc.kfac.compiled`): their factor-update steps run eagerly (``eager_calls``, counted for
the split kind) and the others as the compiled graph, K-FAC's hooks idle.  One more kind compiles the plain model
without that route (``plain_compiled_hooks_traced``: dynamo traces the hooks into the forward, a graph break at
every hooked layer).  The first block (step 0: factors and
decompositions) is a warm-up; no timed block holds a decomposition step.

    python bench/spatial_compiled.py [--sizes 128 256] [--repeats 15] [--backend inductor] [--tag _2026_11_29]
    python bench/spatial_compiled.py --kfac --sizes 128 512 --repeats 4 --tag _kfac_2026_12_07

One torch thread; run it alone on the machine (step times taken beside other work are not figures).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Report  # noqa: E402

from lightning_hpc.kfac import KFACPreconditioner  # noqa: E402
from lightning_hpc.kfac.compiled import CompiledUnderKFAC, attach_compiled  # noqa: E402
from lightning_hpc.models import mesh_fcn  # noqa: E402
from lightning_hpc.spatial.compile import SplitCompiledForward  # noqa: E402
from lightning_hpc.spatial.dispatch import split_tensor  # noqa: E402
from lightning_hpc.spatial.dispatch.kfac_contract import declare_tiled_convolutions  # noqa: E402
from lightning_hpc.spatial.layout.tiling import SpatialGrid  # noqa: E402

KINDS = ("plain", "split", "plain_compiled", "split_compiled")
#: with ``--kfac`` also the plain model compiled without K-FAC's route (its hooks traced into the forward)
KFAC_KINDS = (*KINDS, "plain_compiled_hooks_traced")


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


def kfac_steps(size: int, backend: str) -> tuple[dict[str, Callable[[], None]], SplitCompiledForward,
                                                 CompiledUnderKFAC]:
    """One SGD + K-FAC step of each kind, each kind on its own copy of the model with its own preconditioner; the
    split compiled forward and K-FAC's route over it (:mod:`lightning_hpc.kfac.compiled`), for their counters."""
    torch.manual_seed(0)
    base = mesh_fcn(in_channels=18, convs_per_block=3)
    x = torch.randn(1, 18, size, size)
    y = (torch.rand(1, 1, size, size) > 0.5).float()
    out: dict[str, Callable[[], None]] = {}
    split_compiled: SplitCompiledForward | None = None
    split_route: CompiledUnderKFAC | None = None
    for kind in KFAC_KINDS:
        net = copy.deepcopy(base)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)  # lr 0: every kind steps the same values
        split = kind.startswith("split")
        grid = SpatialGrid.single()
        tiled = declare_tiled_convolutions(net, 1, grid) if split else None
        pre = KFACPreconditioner(net, lr=0.1, tiled_layers=tiled, announce=False)
        forward: Callable[[torch.Tensor], torch.Tensor] = net
        if kind.endswith("compiled"):
            compiled: Any = torch.compile(net, backend=backend)
            if split:  # as the spatial strategy and the K-FAC callback set a compiled module up
                compiled.forward = split_compiled = SplitCompiledForward(compiled)
            (route,) = attach_compiled(pre, compiled)
            if split:
                split_route = route
            forward = compiled
        elif kind == "plain_compiled_hooks_traced":  # no route: dynamo traces K-FAC's hooks into the forward
            forward = torch.compile(net, backend=backend)

        def step(forward=forward, opt=opt, pre=pre, grid=grid, split=split) -> None:
            xs = split_tensor(x, grid, tuple(x.shape)) if split else x
            ys = split_tensor(y, grid, tuple(y.shape)) if split else y
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(forward(xs), ys).backward()
            pre.step()
            opt.step()

        out[kind] = step
    assert split_compiled is not None and split_route is not None
    return out, split_compiled, split_route


def measure_kfac(size: int, repeats: int, backend: str) -> dict[str, float | int | str | None]:
    kinds, split_compiled, route = kfac_steps(size, backend)
    block = 10  # factor_update_freq's default: one factor-update step per block
    for step in kinds.values():  # warm-up: step 0 (factors, decompositions), compiles and traces
        for _ in range(block):
            step()
    times: dict[str, list[float]] = {k: [] for k in KFAC_KINDS}
    for r in range(repeats):
        for k in (KFAC_KINDS if r % 2 else tuple(reversed(KFAC_KINDS))):
            t0 = time.perf_counter()
            for _ in range(block):
                kinds[k]()
            times[k].append((time.perf_counter() - t0) / block)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": size, **{f"{k}_ms": med[k] * 1e3 for k in KFAC_KINDS},
            "split_over_plain": med["split"] / med["plain"],
            "compiled_split_over_compiled_plain": med["split_compiled"] / med["plain_compiled"],
            "compiled_split_over_eager_split": med["split_compiled"] / med["split"],
            "compiled_plain_hooks_traced_over_compiled_plain": med["plain_compiled_hooks_traced"]
            / med["plain_compiled"],
            "graphs": split_compiled.graphs, "traces": split_compiled.traces,
            "eager_calls": route.eager_calls, "refused": split_compiled.refused}


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
    ap.add_argument("--kfac", action="store_true",
                    help="every kind under K-FAC at its defaults, timed by blocks of 10 steps (amortized)")
    ap.add_argument("--tag", default="", help="suffix of the result files (bench/results/spatial_compiled<tag>.*)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = Report(f"spatial_compiled{args.tag}")
    for size in args.sizes:
        report.add(**(measure_kfac if args.kfac else measure)(size, args.repeats, args.backend))
        report.print()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

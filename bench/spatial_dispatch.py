"""The op dispatch's own cost, on one tile: a training step of the mesh-tangling FCN (18 channels, 3 convolutions
per block) on a split activation over ONE tile (every op through ``SpatialTensor.__torch_function__``, the
handlers and the tile kernels; no exchange) against the same step on plain tensors, alternated step by step in
one process.  On a CPU at 128^2 a kernel costs about what it costs on a GPU at 1K, so the small sizes stand for the
GPU's exposure of per-op Python work.

Beside them, the same step on a *protocol floor*: the input re-classed as a ``torch.Tensor`` subclass whose
``__torch_function__`` only calls the op with the subclass switched off and re-classes the result (no layout, no
decision, no alias, no wrap checks). Any split tensor that dispatches through ``__torch_function__`` pays at least
that much (torch's C++ to Python round trip per op, the functionals' ``handle_torch_function``), so the floor's
ratio is what the eager dispatch can approach, and ``added_over_floor_ms`` is the dispatch's own work above it.
``plain_sample_range`` is how far the plain step's samples lie apart in the run ((max - min) / median).

Also counts what stands for the GPU cost independently of the machine's load: the ops dispatched per step
(``__torch_function__`` calls), the Python function calls per step (cProfile) of the split and the plain step,
and their difference per dispatched op; and the decisions the dispatch derives on a repeated step (0: every
decision replayed from the grid's cache).

    python bench/spatial_dispatch.py [--sizes 128 512 1024] [--repeats 15] [--tag _2026_11_27]

One torch thread; run it alone on the machine (step times taken beside other work are not figures).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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
from lightning_hpc.spatial.dispatch import SpatialTensor, split_tensor  # noqa: E402
from lightning_hpc.spatial.layout.tiling import SpatialGrid  # noqa: E402


def one_tile_step(size: int, device: str = "cpu") -> tuple[Callable[[bool], None], SpatialGrid]:
    """``step(split)``: one SGD step of the mesh-tangling FCN on one ``size^2`` sample, on a split activation over
    one tile (``split=True``: every op through the op dispatch) or on plain tensors; and the tile's grid."""
    torch.manual_seed(0)
    net = mesh_fcn(in_channels=18, convs_per_block=3).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(1, 18, size, size, device=device)
    y = (torch.rand(1, 1, size, size, device=device) > 0.5).float()
    grid = SpatialGrid.single()

    def step(split: bool) -> None:
        xs = split_tensor(x, grid, tuple(x.shape)) if split else x
        ys = split_tensor(y, grid, tuple(y.shape)) if split else y
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(net(xs), ys).backward()
        opt.step()

    return step, grid


class ProtocolFloor(torch.Tensor):
    """The least a ``__torch_function__`` subclass does per op: call it with the subclass switched off and
    re-class a new result (the module docstring's protocol floor)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:
            out.__class__ = cls
        return out


def protocol_floor_step(size: int, device: str = "cpu") -> Callable[[], None]:
    """One SGD step of the net of :func:`one_tile_step` (its own copy, the same initial weights) on inputs
    re-classed as :class:`ProtocolFloor`."""
    torch.manual_seed(0)
    net = mesh_fcn(in_channels=18, convs_per_block=3).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(1, 18, size, size, device=device).as_subclass(ProtocolFloor)
    y = (torch.rand(1, 1, size, size, device=device) > 0.5).float().as_subclass(ProtocolFloor)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(net(x), y).backward()
        opt.step()

    return step


def measure(size: int, repeats: int) -> dict[str, float | int]:
    step, grid = one_tile_step(size)
    for split in (False, True, False, True):  # warm-up (and the decisions of the first split step)
        step(split)
    cache = getattr(grid, "decisions", None)
    made = cache.made if cache is not None else -1
    ops = [0]
    real = SpatialTensor.__torch_function__.__func__  # type: ignore[attr-defined]

    def counting(cls, func, types, args=(), kwargs=None):
        ops[0] += 1
        return real(cls, func, types, args, kwargs)

    SpatialTensor.__torch_function__ = classmethod(counting)  # type: ignore[method-assign,assignment]
    try:
        step(True)
    finally:
        SpatialTensor.__torch_function__ = classmethod(real)  # type: ignore[method-assign,assignment]
    new_decisions = cache.made - made if cache is not None else -1

    def python_calls(split: bool) -> int:
        prof = cProfile.Profile()
        prof.enable()
        step(split)
        prof.disable()
        return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]

    calls_split, calls_plain = python_calls(True), python_calls(False)
    floor_step = protocol_floor_step(size)
    floor_step()
    kinds: dict[str, Callable[[], None]] = {"plain": lambda: step(False), "split": lambda: step(True),
                                            "floor": floor_step}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):  # alternated, the order turned every round
        for k in (list(kinds) if r % 2 else list(kinds)[::-1]):
            t0 = time.perf_counter()
            kinds[k]()
            times[k].append(time.perf_counter() - t0)
    plain, dispatched, floor = (statistics.median(times[k]) for k in ("plain", "split", "floor"))
    # how far the plain step's samples lie apart in this run ((max - min) / median): a ratio is no steadier
    plain_range = (max(times["plain"]) - min(times["plain"])) / plain
    return {"size": size, "plain_s": plain, "plain_sample_range": plain_range, "split_s": dispatched,
            "ratio": dispatched / plain,
            "added_ms": (dispatched - plain) * 1e3, "floor_ratio": floor / plain,
            "added_over_floor_ms": (dispatched - floor) * 1e3, "ops_per_step": ops[0], "py_calls_split": calls_split,
            "py_calls_plain": calls_plain, "py_calls_per_op": (calls_split - calls_plain) / max(ops[0], 1),
            "decisions_on_repeat": new_decisions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=15, help="timed steps of each kind per size")
    ap.add_argument("--tag", default="",
                    help="suffix of the result files (bench/results/spatial_dispatch_one_tile<tag>.*)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = Report(f"spatial_dispatch_one_tile{args.tag}")
    for size in args.sizes:
        report.add(**measure(size, args.repeats))
        report.print()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

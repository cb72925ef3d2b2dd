"""Spatial parallelism benchmarks (Dryden et al., Tables I/II and section IV-A), on this machine's CPU/gloo.

Every process runs ONE torch thread (``run_in_processes`` sets it), the 1-process baseline included: on this
2-core machine a "device" is one core.

1. memory:  peak memory per rank for ONE 2048 x 2048 x 18 sample through the 2K mesh model (forward +
            backward) on 1, 2 and 4 processes (tiles 1x1, 2x1, 2x2).  The headline measure is what a GPU user
            reads from ``max_memory_allocated``: the CPU allocator's peak of tensor bytes during the step
            (torch.profiler ``profile_memory``; the "Total Allocated" running count) plus the tensors held
            before it (parameters, buffers, input tile, target).  Also reported: the bytes autograd saves for
            backward (saved-tensor hooks), the peak RSS growth during the step (sampled every 5 ms, minus the
            RSS just before it) and the raw peak RSS (includes the ~300 MiB python + torch + gloo footprint).
            The unchanged model on split activations (SpatialTensor input and target, an unchanged mean loss),
            as the strategy runs a user's module.
2. scaling: strong scaling of the 1K mesh model (one training step: forward, per-pixel loss, backward,
            gradient reduction, SGD) at mini-batch N = 1 and 2 on 1 and 2 processes, Table I style:
            "1 proc/sample" (N = 1: one process; N = 2: sample parallel over 2 processes, or one process) and
            "2 procs/sample" (spatial 2x1).  Configurations interleaved over rounds; medians of all steps.
4. dispatch: one training step of the unchanged model on split activations against the same step written
            against the tile kernels on plain tiles (the op dispatch's overhead), alternating step by step in
            the same 2 processes (small CNN at 256^2, the 1K model at 512^2 and 1024^2); and the all-gathers and
            bytes an op without a tiled form (torch.flip of a split dimension) costs.
3. overlap: the same 1K step on 2 processes with the halo awaited after the tile's own convolution (section
            IV-A) and before it, alternating step by step in the same processes.

The model is the recipes' section VI FCN (``lightning_hpc.models.mesh_fcn``: six blocks of three (1K) or five
(2K) conv-BN-ReLU with 3x3 filters, stride 2 at the first conv of each block, widths 16-32-64-128-256-256, a
1x1 prediction conv and nearest upsampling to the input resolution).

Run alone on the machine (e.g. under `flock` on a lock file that other benchmarks take too):
      python bench/spatial.py --only memory|scaling|overlap  [--repeats 3] [--rounds 3] [--overlap]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
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
from lightning_hpc.models.mesh_fcn import DEFAULT_WIDTHS, mesh_fcn  # noqa: E402
from lightning_hpc.spatial.dispatch import split_tensor, state  # noqa: E402
from lightning_hpc.spatial.dispatch.split_check import check_split  # noqa: E402
from lightning_hpc.spatial.layout.gradients import reduce_model_gradients  # noqa: E402
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout  # noqa: E402


def mesh_model(convs_per_block: int) -> nn.Module:
    """The recipes' section VI FCN (``recipes/mesh_tangling_{1k,2k}.yaml``: widths 16-32-64-128-256-256, nearest
    upsampling), i.e. exactly what ``lightning-hpc train recipe=mesh_tangling_1k`` trains."""
    return mesh_fcn(in_channels=18, convs_per_block=convs_per_block, widths=DEFAULT_WIDTHS)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler(threading.Thread):
    """Peak resident set size while running, sampled every ``period`` seconds."""

    def __init__(self, period: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.period, self.peak, self._stop_flag = period, _rss_bytes(), threading.Event()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop_flag.set()
        self.join()
        return max(self.peak, _rss_bytes())


def _allocator_peak(prof, path: str) -> tuple[int, int]:
    """(peak, end) of the CPU allocator's bytes allocated during a profiled region, relative to its start: the
    CPU analogue of ``torch.cuda.max_memory_allocated() - memory_allocated()`` (tensor bytes only; nothing the
    allocator caches, no fragmentation, no library buffers)."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
    ]
    return (max([0, *totals]), totals[-1] if totals else 0)


def _memory_worker(rank: int, world: int, parts, size: int, convs: int, overlap: bool):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layout = create_hybrid_layout(parts)
    grid = layout.grid
    model = mesh_model(convs)
    check_split(model, (18, size, size), parts)
    grid.policy.overlap = overlap
    # each rank creates only its own tile (as the tile reader does): no rank ever holds the whole sample
    (h0, h1), (w0, w1) = grid.tile_bounds(size, size)
    x = torch.randn(1, 18, h1 - h0, w1 - w0)
    y = (torch.rand(1, 1, h1 - h0, w1 - w0) > 0.5).float()
    held = sum(t.numel() * t.element_size() for t in (x, y, *model.parameters(), *model.buffers()))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if dist.is_initialized():
        dist.barrier()
    before = _rss_bytes()
    sampler = _RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # as the strategy runs it: split activations, the user's unchanged mean loss
            xs, ys = (split_tensor(t, grid, (1, t.shape[1], size, size)) for t in (x, y))
            loss = F.binary_cross_entropy_with_logits(model(xs), ys)
        saved_bytes = sum(saved.values())
        loss.backward()
    step = time.perf_counter() - t0
    peak_rss = sampler.stop()
    alloc_peak, alloc_end = _allocator_peak(prof, f"/tmp/spatial_mem_{os.getpid()}.json")
    mib = 2.0**20
    return {
        "alloc_peak_MiB": (held + alloc_peak) / mib,
        "step_alloc_peak_MiB": alloc_peak / mib,
        "held_before_MiB": held / mib,
        "saved_MiB": saved_bytes / mib,
        "rss_growth_MiB": (peak_rss - before) / mib,
        "rss_peak_MiB": peak_rss / mib,
        "rss_before_MiB": before / mib,
        "input_tile_MiB": x.numel() * 4 / mib,
        "step_s": step,
    }


def bench_memory(report: Report, size: int = 2048, overlap: bool = False) -> None:
    for procs, parts in ((1, (1, 1)), (2, (2, 1)), (4, (2, 2))):
        res = run_in_processes(
            _memory_worker, procs, parts, size, 5, overlap, timeout_s=1800, collective_timeout_s=900
        )
        worst = max(res, key=lambda r: r["alloc_peak_MiB"])
        report.add(
            bench="memory_2k", procs=procs, tiles=f"{parts[0]}x{parts[1]}",
            alloc_peak_MiB=worst["alloc_peak_MiB"], held_before_MiB=worst["held_before_MiB"],
            step_alloc_peak_MiB=max(r["step_alloc_peak_MiB"] for r in res),
            saved_MiB_max_rank=max(r["saved_MiB"] for r in res),
            rss_growth_MiB_max_rank=max(r["rss_growth_MiB"] for r in res),
            rss_peak_MiB_max_rank=max(r["rss_peak_MiB"] for r in res),
            rss_before_MiB=max(r["rss_before_MiB"] for r in res),
            input_tile_MiB=worst["input_tile_MiB"], step_s=max(r["step_s"] for r in res),
        )
        print(report.rows[-1], flush=True)
    base = report.rows[-3]
    for row in report.rows[-3:]:
        for key in ("alloc_peak_MiB", "saved_MiB_max_rank", "rss_growth_MiB_max_rank", "rss_peak_MiB_max_rank"):
            row[key.replace("_MiB", "").replace("_max_rank", "") + "_vs_1proc"] = row[key] / base[key]


def _train_worker(rank: int, world: int, parts, batch: int, size: int, overlap, repeats: int):
    """Median-able step times; ``overlap="alternate"`` toggles the halo overlap of every conv between steps
    (same process, same weights, so the comparison sees the same machine load)."""
    torch.manual_seed(0)
    layout = create_hybrid_layout(parts)
    grid = layout.grid
    model = mesh_model(3)
    check_split(model, (18, size, size), parts)
    grid.tile_params.clear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s0, s1 = block_range(batch, layout.num_sample_groups, layout.sample_index)
    (h0, h1), (w0, w1) = grid.tile_bounds(size, size)
    g = torch.Generator().manual_seed(layout.sample_index)
    x = split_tensor(torch.randn(s1 - s0, 18, h1 - h0, w1 - w0, generator=g), grid, (s1 - s0, 18, size, size))
    y = split_tensor((torch.rand(s1 - s0, 1, h1 - h0, w1 - w0, generator=g) > 0.5).float(), grid,
                     (s1 - s0, 1, size, size))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        reduce_model_gradients(model, layout.num_sample_groups, grid.tile_params)
        opt.step()

    times: dict[bool, list[float]] = {True: [], False: []}
    modes = [True, False] if overlap == "alternate" else [bool(overlap)]
    step()  # warm-up
    for k in range(repeats * len(modes)):
        mode = modes[k % len(modes)]
        grid.policy.overlap = mode  # read by the convolution handler at every call
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step()
        if dist.is_initialized():
            dist.barrier()
        times[mode].append(time.perf_counter() - t0)
    return times if overlap == "alternate" else times[bool(overlap)]


def _steps(procs: int, parts, batch: int, size: int, overlap, repeats: int):
    return run_in_processes(
        _train_worker, procs, parts, batch, size, overlap, repeats, timeout_s=1800, collective_timeout_s=900
    )[0]


def bench_scaling(report: Report, repeats: int, size: int = 1024, rounds: int = 3, overlap: bool = False) -> None:
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
                samples.setdefault((batch, name), []).extend(_steps(procs, parts, batch, size, overlap, repeats))
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
    report.add(
        bench="overlap_1k",
        N=1,
        config="spatial 2x1, overlap on",
        procs=2,
        step_s=on,
        step_s_min=min(times[True]),
        steps=len(times[True]),
        speedup_vs_off=off / on,
    )
    report.add(
        bench="overlap_1k",
        N=1,
        config="spatial 2x1, overlap off",
        procs=2,
        step_s=off,
        step_s_min=min(times[False]),
        steps=len(times[False]),
        speedup_vs_off=1.0,
    )
    print(report.rows[-2:], flush=True)


def _small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Upsample(scale_factor=2), nn.Conv2d(32, 1, 1))


def _kernel_step_forward(model: nn.Module, x: torch.Tensor, grid, extents: tuple[int, ...]) -> torch.Tensor:
    """The same forward as the dispatched one on a plain tile, calling the tile kernels directly: what a
    hand-written spatial-parallel model would run (no ``SpatialTensor``, no handler lookup, no argument binding).
    The benchmark's models are sequences of the layers below only."""
    from lightning_hpc.spatial import kernels as K
    from lightning_hpc.spatial.dispatch.norms import _update_running
    from lightning_hpc.spatial.kernels.normalization import aggregated_batch_norm

    for layer in (m for m in model.modules() if not list(m.children())):
        if isinstance(layer, nn.Conv2d):
            x = K.conv(x, layer.weight, layer.bias, grid, extents, layer.stride, layer.padding, layer.dilation,
                       layer.groups)
            extents = K.output_extents(extents, K.convolution_windows(layer.weight.shape, layer.stride,
                                                                      layer.padding, layer.dilation))
        elif isinstance(layer, nn.BatchNorm2d):
            x, mean, var, n = aggregated_batch_norm(x, layer.weight, layer.bias, layer.eps, grid.group)
            # the running statistics, as the layer (and the dispatched step) updates them
            momentum = 0.1 if layer.momentum is None else layer.momentum
            _update_running(layer.running_mean, layer.running_var, mean, var * (n / max(n - 1.0, 1.0)), momentum)
        elif isinstance(layer, nn.ReLU):
            x = F.relu(x, inplace=layer.inplace)
        elif isinstance(layer, nn.MaxPool2d):
            windows = K.pooling_windows(2, layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                                        layer.ceil_mode)
            x = K.max_pool(x, grid, extents, layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                           layer.ceil_mode)
            extents = K.output_extents(extents, windows)
        elif isinstance(layer, nn.Upsample):
            windows = K.interpolation_windows(extents, layer.size, layer.scale_factor, layer.mode,
                                              layer.align_corners)
            x = K.interpolate(x, grid, extents, layer.size, layer.scale_factor, layer.mode, layer.align_corners)
            extents = K.output_extents(extents, windows)
        else:
            raise TypeError(f"the kernel baseline has no call for {type(layer).__name__}")
    return x


def _dispatch_worker(rank: int, world: int, model_name: str, size: int, repeats: int):
    """One training step (forward, mean loss, backward, gradient reduction) of the unchanged model on split
    activations (``SpatialTensor`` input and target, a plain mean loss), alternating step by step with the same
    step written against the tile kernels directly (plain tiles, the loss as a local sum over the global pixel
    count, its value all-reduced as the dispatched mean is): the difference is the op dispatch's cost.  Also the
    gathers an op without a tiled form (torch.flip of H) costs."""
    from lightning_hpc.spatial.layout.tiling import tile_slices

    layout = create_hybrid_layout((2, 1))
    grid = layout.grid
    cin = 18 if model_name == "mesh" else 3
    torch.manual_seed(0)
    model = mesh_model(3) if model_name == "mesh" else _small_cnn()
    x = torch.randn(1, cin, size, size)
    y = (torch.rand(1, 1, size, size) > 0.5).float()
    rs, cs = tile_slices((size, size), (2, 1), grid.index)
    xt, yt = x[..., rs, cs].contiguous(), y[..., rs, cs].contiguous()

    def dispatched() -> torch.Tensor:
        xs = split_tensor(xt, grid, x.shape)
        ys = split_tensor(yt, grid, y.shape)
        loss = F.binary_cross_entropy_with_logits(model(xs), ys)
        loss.backward()
        return loss

    def kernels() -> torch.Tensor:
        out = _kernel_step_forward(model, xt, grid, (size, size))
        loss = F.binary_cross_entropy_with_logits(out, yt, reduction="sum") / y.numel()
        loss.backward()
        value = loss.detach().clone()
        dist.all_reduce(value, group=grid.group)
        return value

    times: dict[str, list[float]] = {"dispatch": [], "kernels": []}
    losses: dict[str, float] = {}
    for step in range(repeats + 1):
        for mode, fn in (("dispatch", dispatched), ("kernels", kernels)) if step % 2 else \
                (("kernels", kernels), ("dispatch", dispatched)):
            # every parameter of these models meets tiles (no head after a global pooling): both steps sum all
            # gradients over the spatial group
            grid.tile_params.clear()
            grid.tile_params.update({id(p): p for p in model.parameters()})
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn()
            reduce_model_gradients(model, 1, grid.tile_params)
            elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            losses[mode] = float(loss)
            if step:
                times[mode].append(elapsed)
    st = state()
    g0, b0 = st.gathers, st.gathered_bytes
    xs = split_tensor(xt, grid, x.shape)
    torch.flip(xs, (2,))
    return {"times": times, "losses": losses, "flip_gathers": st.gathers - g0, "flip_bytes": st.gathered_bytes - b0,
            "activation_bytes": x.numel() * x.element_size()}


def bench_dispatch(report: Report, repeats: int, size_1k: int) -> None:
    for model_name, size in (("small_cnn", 256), ("mesh", 512), ("mesh", size_1k)):
        res = run_in_processes(_dispatch_worker, 2, model_name, size, repeats, timeout_s=1800)
        t = res[0]["times"]
        dispatch, kernels = statistics.median(t["dispatch"]), statistics.median(t["kernels"])
        report.add(bench="dispatch", model=model_name, size=size, procs=2, parts="2x1",
                   step_s=dispatch, kernel_step_s=kernels, overhead=dispatch / kernels - 1.0,
                   steps=len(t["dispatch"]), loss_dispatch=res[0]["losses"]["dispatch"],
                   loss_kernels=res[0]["losses"]["kernels"], flip_gathers=res[0]["flip_gathers"],
                   flip_gathered_bytes=res[0]["flip_bytes"], activation_bytes=res[0]["activation_bytes"])
        print(report.rows[-1], flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["memory", "scaling", "overlap", "dispatch"], action="append")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per process group (after 1 warm-up)")
    ap.add_argument("--size-2k", type=int, default=2048)
    ap.add_argument("--size-1k", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="scaling: interleaved rounds over the configurations")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="memory/scaling: the halo awaited after the tile's own convolution (section IV-A) instead of "
        "before it (the default)",
    )
    ap.add_argument("--tag", default="", help="suffix of the result files (bench/results/spatial_<bench><tag>.*)")
    args = ap.parse_args(argv)
    which = args.only or ["memory", "scaling", "overlap"]
    for name in which:
        report = Report(
            f"spatial_{name}{args.tag}",
            meta={
                "note": "2 CPU cores shared with other jobs; gloo; 1 thread per rank",
                "widths": DEFAULT_WIDTHS,
                "overlap": args.overlap,
                "loadavg_start": os.getloadavg(),
            },
        )
        if name == "memory":
            bench_memory(report, args.size_2k, args.overlap)
        elif name == "scaling":
            bench_scaling(report, args.repeats, args.size_1k, args.rounds, args.overlap)
        elif name == "dispatch":
            bench_dispatch(report, args.repeats, args.size_1k)
        else:
            bench_overlap(report, args.repeats, args.size_1k)
        report.meta["loadavg_end"] = os.getloadavg()
        report.print()
        report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Layer-parallel multigrid benchmark (Kirby et al.): serial vs partitioned model (PM) vs multigrid (MG).

1. Measured: time per forward pass and per training step (forward + backward + SGD step) of an ODE-ResNet
   (width 4, 8x8 states, batch 8, float32) with 256 .. 4,096 residual steps, on 1 and 2 CPU processes (gloo);
   ratios to serial in the same job.  MG: cfactor 4, 3 levels, F-relaxation, 2 forward + 2 backward cycles.
2. Single-device MG (2 cycles) forward over serial forward (target <= 2x; the paper's GPU code was ~4x), and
   the same solver evaluating the blocks one after the other (no batching) for comparison.
3. Projection of the paper's 2,071,328,150-parameter, 4,115-layer training experiment (Fig. 7) to 4..64
   devices with the shared performance model: measured layer times (LayerTimer) and alpha-beta network.

    PYTHONPATH=. python bench/multigrid.py [--depths 256 1024 4096] [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Report, timeit  # noqa: E402

from lightning_hpc.distributed import run_in_processes  # noqa: E402
from lightning_hpc.models import ode_resnet  # noqa: E402
from lightning_hpc.models.ode_resnet import conv_branch  # noqa: E402
from lightning_hpc.multigrid import (  # noqa: E402
    MultigridODEBlock,
    MultigridOptions,
    PartitionedODEBlock,
    SolveSettings,
)
from lightning_hpc.multigrid.cost import multigrid_step_time, partitioned_step_time  # noqa: E402
from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, calibrate_local  # noqa: E402

MG = dict(cfactor=4, levels=3, relaxation="F")
BATCH, WIDTH = 8, 4


def build(method: str, depth: int, group, concurrent: bool = True) -> nn.Module:
    torch.manual_seed(0)
    net = ode_resnet(1, 10, 8, width=WIDTH, num_steps=depth, final_time=2.0)
    if method == "pm":
        net.steps = PartitionedODEBlock(net.steps, group=group)
    elif method == "mg":
        opts = MultigridOptions(**MG, forward=SolveSettings(2), backward=SolveSettings(2), concurrent=concurrent)
        net.steps = MultigridODEBlock(net.steps, opts, group=group)
    return net


def measure(method: str, depth: int, group, repeats: int, concurrent: bool = True) -> tuple[float, float]:
    """Median seconds per forward (no grad) and per training step; the slowest rank counts."""
    net = build(method, depth, group, concurrent)
    x = torch.randn(BATCH, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(BATCH) % 10
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def sync_time(fn):
        def run():
            if group is not None:
                dist.barrier(group)
            fn()

        return run

    def forward():
        with torch.no_grad():
            net(x)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    fwd = timeit(sync_time(forward), warmup=1, repeats=repeats).median
    stp = timeit(sync_time(step), warmup=1, repeats=repeats).median
    if group is not None:
        t = torch.tensor([fwd, stp], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        fwd, stp = float(t[0]), float(t[1])
    return fwd, stp


def single_device(depths: list[int], repeats: int) -> Report:
    """MG (2 cycles) forward over serial forward on one process, the two timed alternately (same load)."""
    torch.set_num_threads(1)
    report = Report(
        "multigrid_single_device",
        meta={
            "model": f"ode_resnet width {WIDTH}, 8x8, batch {BATCH}, fp32",
            "mg": {**MG, "cycles": 2},
            "timing": "interleaved serial/MG, medians",
        },
    )
    x = torch.randn(BATCH, 1, 8, 8)
    for depth in depths:
        serial, mg = build("serial", depth, None), build("mg", depth, None)
        times: dict[str, list[float]] = {"serial": [], "mg": []}
        with torch.no_grad():
            serial(x), mg(x)
            for _ in range(repeats):
                for name, net in (("serial", serial), ("mg", mg)):
                    t0 = time.perf_counter()
                    net(x)
                    times[name].append(time.perf_counter() - t0)
        s_med, m_med = statistics.median(times["serial"]), statistics.median(times["mg"])
        pairwise = statistics.median(m / s for m, s in zip(times["mg"], times["serial"]))
        report.add(
            depth=depth, serial_forward_s=s_med, mg_forward_s=m_med, ratio=m_med / s_med, pairwise_ratio=pairwise
        )
        print(report.rows[-1], flush=True)
    return report


def _worker(rank: int, world_size: int, depths: list[int], repeats: int) -> list[dict]:
    rows = []
    for depth in depths:
        for method in ("pm", "mg"):
            fwd, stp = measure(method, depth, dist.group.WORLD, repeats)
            rows.append(dict(depth=depth, procs=world_size, method=method, forward_s=fwd, step_s=stp))
    return rows


def measured(depths: list[int], repeats: int) -> Report:
    torch.set_num_threads(1)
    report = Report(
        "multigrid_measured",
        meta={
            "model": f"ode_resnet width {WIDTH}, 8x8, batch {BATCH}, fp32",
            "mg": {**MG, "cycles": 2},
            "machine": "2 shared CPU cores (other jobs running): noisy",
        },
    )
    for depth in depths:
        for method in ("serial", "pm", "mg"):
            fwd, stp = measure(method, depth, None, repeats)
            report.add(depth=depth, procs=1, method=method, forward_s=fwd, step_s=stp)
            print(report.rows[-1], flush=True)
        if depth <= 1024:  # ~10x slower than batched: skipped for the deepest net to keep the run short
            fwd, stp = measure("mg", depth, None, repeats, concurrent=False)
            report.add(depth=depth, procs=1, method="mg_block_after_block", forward_s=fwd, step_s=stp)
            print(report.rows[-1], flush=True)
    for row in run_in_processes(_worker, 2, depths, repeats, timeout_s=3600, collective_timeout_s=1800)[0]:
        report.add(**row)
    for row in report.rows:  # ratios to serial on one process at the same depth
        base = next(r for r in report.rows if r["depth"] == row["depth"] and r["method"] == "serial")
        row["forward_vs_serial"] = row["forward_s"] / base["forward_s"]
        row["step_vs_serial"] = row["step_s"] / base["step_s"]
    return report


# -- projection of Fig. 7 -------------------------------------------------------------------------------
FIG7_CHANNELS, FIG7_HW, FIG7_BATCH = 20, 24, 8
PAPER_SPEEDUP = {4: 1.3, 64: 10.2}


class FlatLinear(nn.Module):
    """F(u) = ReLU(W vec(u) + b) reshaped back: the 'fully connected layer with matching input and output
    dimensions' of Fig. 7's sequence blocks, as a residual step."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(math.prod(shape), math.prod(shape))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(u.flatten(1))).view(u.shape)


def fig7_layer_times(timer: LayerTimer, convs_per_block: int = 256) -> tuple[list[float], list[float], dict]:
    """Per-step forward / backward times of 16 x [FC + ``convs_per_block`` conv 7x7] residual steps (Fig. 7:
    256 -> 4,112 steps; 255 -> 4,096 steps, which coarsen by powers of two down to a few coarse steps)."""
    shape = (FIG7_BATCH, FIG7_CHANNELS, FIG7_HW, FIG7_HW)
    conv = timer.measure(conv_branch(FIG7_CHANNELS, 7), shape)
    fc = timer.measure(FlatLinear(shape[1:]), shape)
    fwd, bwd = [], []
    for _ in range(16):
        fwd.append(fc["forward"])
        bwd.append(fc["backward"])
        fwd += [conv["forward"]] * convs_per_block
        bwd += [conv["backward"]] * convs_per_block
    params = (
        16 * (FIG7_CHANNELS * FIG7_HW**2) ** 2
        + 16 * FIG7_CHANNELS * FIG7_HW**2
        + 4096 * (FIG7_CHANNELS**2 * 49 + FIG7_CHANNELS)
    )
    params += 1 * FIG7_CHANNELS * 49 + FIG7_CHANNELS + FIG7_CHANNELS * FIG7_HW**2 * 10 + 10
    return (
        fwd,
        bwd,
        {
            "conv_fwd_s": conv["forward"],
            "conv_bwd_s": conv["backward"],
            "fc_fwd_s": fc["forward"],
            "fc_bwd_s": fc["backward"],
            "params": params,
        },
    )


def v100_like(
    fwd: list[float], bwd: list[float], conv_flops: float, fc_flops: float, rate: float = 7e12
) -> tuple[list[float], list[float]]:
    """Scenario: the same layers at an effective ``rate`` FLOP/s (V100-class), backward = 2x forward."""
    period = len(fwd) // 16
    f = [(fc_flops if i % period == 0 else conv_flops) / rate for i in range(len(fwd))]
    return f, [2 * t for t in f]


def projection(model_local: AlphaBeta) -> Report:
    torch.set_num_threads(1)
    timer = LayerTimer(warmup=1, repeats=3)
    n_feat = FIG7_CHANNELS * FIG7_HW**2
    conv_flops = 2 * FIG7_BATCH * FIG7_CHANNELS * FIG7_CHANNELS * 49 * FIG7_HW**2
    fc_flops = 2 * FIG7_BATCH * n_feat * n_feat
    message = FIG7_BATCH * n_feat * 4
    ethernet = AlphaBeta(alpha=30e-6, beta=8 / 25e9)  # 25 Gb/s Ethernet (the paper's TX-GAIA interconnect)
    scenarios = {}
    for convs in (256, 255):
        fwd, bwd, info = fig7_layer_times(timer, convs)
        steps = len(fwd)
        scenarios[f"{steps} steps, measured CPU layers + local gloo"] = (fwd, bwd, model_local)
        scenarios[f"{steps} steps, V100-like 7 TFLOP/s + 25 GbE"] = (
            *v100_like(fwd, bwd, conv_flops, fc_flops),
            ethernet,
        )
    meta = {
        "layer_info": info,
        "alpha_beta_local": model_local.to_dict(),
        "ethernet": ethernet.to_dict(),
        "mg": "F-relaxation, 2 forward + 2 adjoint cycles, best (cfactor, levels)",
        "message_bytes": message,
    }
    report = Report("multigrid_projection_fig7", meta=meta)
    # every hierarchy the depth allows (c^(levels-1) must divide it; 4,112 = 2^4 x 257 keeps >= 257 coarse
    # steps); the best one per device count is reported, as a user would tune cfactor / levels
    for name, (f, b, net) in scenarios.items():
        n = len(f)
        hierarchies = [(c, lv) for c in (2, 4, 8, 16) for lv in range(2, 8) if n % c ** (lv - 1) == 0]
        for p in (4, 8, 16, 32, 64):
            best = min(
                ((multigrid_step_time(f, b, p, c, lv, 2, 2, "F", message, net), c, lv) for c, lv in hierarchies),
                key=lambda t: t[0]["step"],
            )
            mg, c, lv = best
            pm = partitioned_step_time(f, b, p, message, net)
            report.add(
                scenario=name,
                devices=p,
                cfactor=c,
                levels=lv,
                mg_step_s=mg["step"],
                pm_step_s=pm["step"],
                mg_comm_fraction=mg["communication"] / mg["step"],
                speedup_mg_vs_pm=pm["step"] / mg["step"],
                paper_speedup=PAPER_SPEEDUP.get(p),
            )
    return report


def plot(measured_report: Report, proj: Report) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for method, style in (("serial", "k-o"), ("pm", "b-s"), ("mg", "r-^"), ("mg_block_after_block", "r:^")):
        for procs, alpha in ((1, 1.0), (2, 0.5)):
            rows = [r for r in measured_report.rows if r["method"] == method and r["procs"] == procs]
            if rows:
                axes[0].plot(
                    [r["depth"] for r in rows],
                    [r["step_s"] for r in rows],
                    style,
                    alpha=alpha,
                    label=f"{method} ({procs} proc)",
                )
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("residual steps")
    axes[0].set_ylabel("s per training step")
    axes[0].set_title("measured (2 shared CPU cores)")
    axes[0].legend(fontsize=7)
    styles = ["g-o", "m-s", "g--o", "m--s"]
    for scenario, style in zip(dict.fromkeys(r["scenario"] for r in proj.rows), styles):
        rows = [r for r in proj.rows if r["scenario"] == scenario]
        axes[1].plot([r["devices"] for r in rows], [r["speedup_mg_vs_pm"] for r in rows], style, label=scenario)
    axes[1].plot([4, 64], [1.3, 10.2], "k*", markersize=10, label="paper (Fig. 7)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("devices")
    axes[1].set_ylabel("MG speedup over PM (training step)")
    axes[1].set_title("projection of Fig. 7 (2-billion-parameter net)")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    out = Path(__file__).resolve().parent / "results" / "multigrid.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"figure: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument(
        "--single-device", action="store_true", help="only the interleaved single-device MG/serial forward ratio"
    )
    args = parser.parse_args()
    if args.single_device:
        rep = single_device(args.depths, max(args.repeats, 9))
        rep.print()
        rep.write()
        return
    t0 = time.time()
    model_local = calibrate_local(2)
    proj = projection(model_local)
    proj.print()
    proj.write()
    if args.skip_measured:
        return
    rep = measured(args.depths, args.repeats)
    rep.print(["depth", "procs", "method", "forward_s", "step_s", "forward_vs_serial", "step_vs_serial"])
    rep.write()
    plot(rep, proj)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

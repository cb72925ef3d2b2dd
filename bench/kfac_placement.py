"""K-FAC decomposition placement: round_robin (SC20) vs balanced (LPT) vs layer_wise, ResNet-50/101/152 at 16,
32 and 64 ranks (``plan-kfac``'s numbers: max / mean per-rank cost, max / lower bound).

Cost is the ``n^3`` model of an eigendecomposition; ``--check-model`` also times ``torch.linalg.eigh`` at a few
sizes on this machine and fits the exponent, to show how well ``n^3`` predicts the measured time here.

    python bench/kfac_placement.py [--check-model]
"""

from __future__ import annotations

import argparse
import math

import torch
from harness import Report, timeit

from lightning_hpc.cli.plan_kfac import plan
from lightning_hpc.kfac.placement import PLACEMENTS


def eigh_exponent(sizes: tuple[int, ...] = (128, 256, 512, 1024)) -> tuple[float, list[tuple[int, float]]]:
    times = []
    for n in sizes:
        m = torch.randn(n, n)
        sym = m @ m.t() / n
        times.append((n, timeit(lambda: torch.linalg.eigh(sym), warmup=1, repeats=3).median))
    xs = [math.log(n) for n, _ in times]
    ys = [math.log(t) for _, t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "resnet101", "resnet152"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--check-model", action="store_true")
    args = ap.parse_args()
    report = Report("kfac_placement")
    for model in args.models:
        for world in args.worlds:
            for placement in PLACEMENTS:
                p = plan(model, world, placement)
                report.add(
                    label=f"{model}/{world}/{placement}", model=model, world=world, placement=placement,
                    max_cost=p["max_cost"], mean_cost=p["mean_cost"], lower_bound=p["lower_bound_cost"],
                    max_over_mean=p["max_over_mean"], max_over_lower_bound=p["max_over_lower_bound"],
                    max_numel=max(r["numel"] for r in p["ranks"]), min_numel=min(r["numel"] for r in p["ranks"]),
                )  # fmt: skip
    report.add_ratios(
        "placement", "max_cost", "round_robin", ratio_name="max_cost_vs_round_robin", group_by=("model", "world")
    )
    if args.check_model:
        torch.set_num_threads(1)
        slope, times = eigh_exponent()
        report.meta.update(
            eigh_fitted_exponent=slope, eigh_times=times, note="eigh timed on a shared 2-core machine (noisy)"
        )
        print(f"eigh time ~ n^{slope:.2f} on this machine: {[(n, round(t, 4)) for n, t in times]}")
    report.print(
        [
            "model",
            "world",
            "placement",
            "max_over_mean",
            "max_over_lower_bound",
            "max_cost_vs_round_robin",
            "min_numel",
            "max_numel",
        ]
    )
    report.write()
    balanced_vs_rr = Report("kfac_placement_plot", rows=[r for r in report.rows if r["placement"] != "layer_wise"])
    balanced_vs_rr.plot_bars(
        "label", "max_over_mean", title="K-FAC decomposition: max / mean per-rank cost (n^3)", ylabel="max / mean"
    )


if __name__ == "__main__":
    main()

"""K-FAC convergence on real data: digits CNN or ResNet, SGD vs SGD + K-FAC vs Adam, epochs and time to 97% val acc.

Same model (``--model``: ``small_cnn``, or ``resnet``: the CIFAR ResNet-8, its smallest depth), data split, batch
size and weight decay (1e-4) for all; SGD and K-FAC use momentum 0.9, K-FAC preconditions the gradients SGD then
applies; Adam (``torch.optim.Adam``, the 1e-4 weight decay added to the gradient as for SGD) has its own lr grid.
A run trains until the validation accuracy, checked ``--evals-per-epoch`` times per epoch (fractional epochs),
reaches ``--target``; time counts training only (evaluation excluded for all), as wall time and as process CPU
time (one thread: on a loaded shared machine the CPU time is the meaningful cost).

Tuning is the same for all methods and uses seeds (``--tune-seeds``) disjoint from the reported ones (``--seeds``):

1. ``lr``: SGD and K-FAC over the same learning-rate grid (K-FAC with the ``--damping`` / ``--kl-clip`` /
   interval defaults), Adam over ``--adam-lrs``; each method keeps its best lr (lowest median epochs to target;
   CPU time breaks ties);
2. ``kfac``: K-FAC's damping x kl_clip x (factor, decomposition) interval grid at its best lr;
3. ``lr2``: the lr grid again for K-FAC with the best K-FAC setting (SGD and Adam have nothing more to tune);
4. ``final``: all methods at their chosen settings on the reported seeds (median of those).

A run that does not reach the target within ``--sweep-max-epochs`` (tuning) or ``--max-epochs`` (final) counts as
never reaching it. ``--stages final`` with explicit ``--sgd-lr`` / ``--kfac-lr`` / ``--adam-lr`` / ... reruns only
the comparison.
``--select time`` picks instead the lowest median CPU time among the K-FAC settings within ``--epoch-ratio`` x
SGD's tuned epochs. ``--sample-fraction(s)`` runs the optional A-subsampling variant
(``conv_input_sample_fraction``, off at 1.0); ``--tag`` suffixes the result files so runs do not overwrite each other.

    python bench/kfac_convergence.py [--model small_cnn|resnet] [--stages lr kfac lr2 final] [--seeds 0 1 2]
        [--tune-seeds 10 11 12]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import torch
import torch.nn.functional as F
from harness import Report
from torch.utils.data import DataLoader

from lightning_hpc.data.digits import load_digits_tensors
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.models import cifar_resnet, small_cnn

STAGES = ("lr", "kfac", "lr2", "final")
#: 1x8x8 digits, 10 classes; ResNet-8 is the smallest CIFAR ResNet (6n+2, n=1)
MODELS = {"small_cnn": lambda: small_cnn(1, 10), "resnet": lambda: cifar_resnet(8, 10, in_channels=1)}
#: K-FAC settings a configuration names (the tuned ones and the optional A-subsampling variant, off at 1.0)
KFAC_KEYS = (
    "damping",
    "kl_clip",
    "factor_update_freq",
    "inv_update_freq",
    "factor_decay",
    "conv_input_sample_fraction",
    "compute_method",
)


def run(method: str, seed: int, lr: float, kfac: dict, max_epochs: int, args: argparse.Namespace) -> dict:
    """One training run; returns fractional epochs / seconds to the target (None if never reached)."""
    torch.manual_seed(seed)
    train, val = load_digits_tensors(0.2, seed=0)
    loader = DataLoader(train, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(seed))
    xv, yv = val.tensors
    model = MODELS[args.model]()
    if method == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    pre = KFACPreconditioner(model, optimizer=opt, **kfac) if method == "kfac" else None
    steps_per_epoch = len(loader)
    eval_every = max(1, steps_per_epoch // args.evals_per_epoch)
    train_time, cpu_time, acc, step = 0.0, 0.0, 0.0, 0

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            out = float((model(xv).argmax(1) == yv).float().mean())
        model.train()
        return out

    for _epoch in range(max_epochs):
        model.train()
        for x, y in loader:
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            train_time += time.perf_counter() - t0
            cpu_time += time.process_time() - c0
            step += 1
            if not math.isfinite(float(loss)):
                return {"epochs": None, "seconds": None, "cpu_seconds": None, "final_acc": acc, "diverged": True}
            if step % eval_every == 0 or step % steps_per_epoch == 0:
                acc = evaluate()
                if acc >= args.target:
                    return {
                        "epochs": round(step / steps_per_epoch, 3),
                        "seconds": train_time,
                        "cpu_seconds": cpu_time,
                        "final_acc": acc,
                    }
    return {"epochs": None, "seconds": None, "cpu_seconds": None, "final_acc": acc}


def _median(values: list[float | None]) -> float:
    """Median with never-reached runs as +inf (so a config that misses on 2 of 3 seeds ranks last)."""
    return statistics.median(math.inf if v is None else v for v in values)


def evaluate_config(
    method: str, lr: float, kfac: dict, seeds: list[int], max_epochs: int, args: argparse.Namespace
) -> dict:
    runs = [run(method, s, lr, kfac, max_epochs, args) for s in seeds]
    return {
        "method": method,
        "lr": lr,
        **({k: kfac[k] for k in KFAC_KEYS} if method == "kfac" else {}),
        "reached": sum(r["epochs"] is not None for r in runs),
        "median_epochs": _median([r["epochs"] for r in runs]),
        "median_seconds": _median([r["seconds"] for r in runs]),
        "median_cpu_seconds": _median([r["cpu_seconds"] for r in runs]),
        "epochs_per_seed": [r["epochs"] for r in runs],
        "median_final_acc": statistics.median(r["final_acc"] for r in runs),
    }


def _best(rows: list[dict], select: str = "epochs", epoch_cap: float = math.inf) -> dict:
    """``epochs``: lowest median epochs (CPU time breaks ties). ``time``: lowest median CPU time among the rows
    whose median epochs are <= ``epoch_cap`` (the epoch target on the tuning seeds), else by epochs."""
    if select == "time":
        ok = [r for r in rows if r["median_epochs"] <= epoch_cap]
        if ok:
            return min(ok, key=lambda r: (r["median_cpu_seconds"], r["median_epochs"]))
    return min(rows, key=lambda r: (r["median_epochs"], r["median_cpu_seconds"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="small_cnn")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="reported seeds")
    ap.add_argument("--tune-seeds", type=int, nargs="+", default=[10, 11, 12], help="seeds of the tuning sweeps")
    ap.add_argument("--target", type=float, default=0.97)
    ap.add_argument("--max-epochs", type=int, default=40)
    ap.add_argument("--sweep-max-epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.05, 0.1, 0.2, 0.4])
    ap.add_argument("--adam-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    ap.add_argument("--dampings", type=float, nargs="+", default=[0.001, 0.003, 0.01, 0.03])
    ap.add_argument("--kl-clips", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    ap.add_argument("--intervals", nargs="+", default=["1:5", "1:10", "5:20"], help="factor:decomposition intervals")
    ap.add_argument(
        "--factor-decays",
        type=float,
        nargs="+",
        default=[0.95],
        help="running-average weights xi (Eq 16-17) of the kfac stage",
    )
    ap.add_argument(
        "--compute-methods",
        nargs="+",
        default=["eigen"],
        choices=("eigen", "inverse"),
        help="Eq 13-15 or Eq 11-12 (kfac stage)",
    )
    ap.add_argument(
        "--sample-fractions",
        type=float,
        nargs="+",
        default=[1.0],
        help="conv_input_sample_fraction values of the kfac stage (optional variant; 1.0 = the default KFC factors)",
    )
    ap.add_argument("--sgd-lr", type=float, default=0.05, help="used when the lr stage is skipped")
    ap.add_argument("--kfac-lr", type=float, default=0.05, help="used when the lr / lr2 stages are skipped")
    ap.add_argument("--adam-lr", type=float, default=1e-3, help="used when the lr stage is skipped")
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--kl-clip", type=float, default=0.01)
    ap.add_argument("--factor-every", type=int, default=1)
    ap.add_argument("--decomp-every", type=int, default=10)
    ap.add_argument("--factor-decay", type=float, default=0.95)
    ap.add_argument("--compute-method", default="eigen", choices=("eigen", "inverse"))
    ap.add_argument(
        "--sample-fraction",
        type=float,
        default=1.0,
        help="conv_input_sample_fraction (optional variant; 1.0 = default)",
    )
    ap.add_argument(
        "--select",
        choices=("epochs", "time"),
        default="epochs",
        help="tuning choice: lowest median epochs, or lowest median CPU time among the K-FAC settings whose median "
        "epochs are <= --epoch-ratio x SGD's tuned median epochs (SGD: lowest time over its lr grid)",
    )
    ap.add_argument("--epoch-ratio", type=float, default=0.6)
    ap.add_argument(
        "--sgd-tuned-epochs", type=float, default=None, help="SGD's tuned median epochs when the lr stage is skipped"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--tag", default="", help="suffix of the result files (e.g. _b128), so runs do not overwrite each other"
    )
    ap.add_argument(
        "--evals-per-epoch", type=int, default=12, help="validation checks per epoch (fractional epochs to target)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sgd_lr, kfac_lr, adam_lr = args.sgd_lr, args.kfac_lr, args.adam_lr
    kfac = {"damping": args.damping, "kl_clip": args.kl_clip, "factor_update_freq": args.factor_every,
            "inv_update_freq": args.decomp_every, "factor_decay": args.factor_decay,
            "conv_input_sample_fraction": args.sample_fraction, "compute_method": args.compute_method}  # fmt: skip
    tuned = [s for s in STAGES[:-1] if s in args.stages]
    sweep = Report(
        "kfac_convergence_sweep" + ("" if len(tuned) == len(STAGES) - 1 else "_" + "_".join(tuned)) + args.tag
    )
    sweep.meta.update(vars(args))

    def tune(stage: str, method: str, lr: float, opts: dict) -> dict:
        row = sweep.add(stage=stage, **evaluate_config(method, lr, opts, args.tune_seeds, args.sweep_max_epochs, args))
        print(row, flush=True)
        return row

    sgd_epochs = args.sgd_tuned_epochs
    if "lr" in args.stages:
        sgd_best = _best([tune("lr", "sgd", lr, {}) for lr in args.lrs], args.select)
        sgd_lr, sgd_epochs = sgd_best["lr"], sgd_best["median_epochs"]
        kfac_lr = _best([tune("lr", "kfac", lr, kfac) for lr in args.lrs])["lr"]
        adam_lr = _best([tune("lr", "adam", lr, {}) for lr in args.adam_lrs], args.select)["lr"]
    if args.select == "time" and sgd_epochs is None and ("kfac" in args.stages or "lr2" in args.stages):
        ap.error("--select time needs SGD's tuned epochs: run the lr stage or pass --sgd-tuned-epochs")
    cap = args.epoch_ratio * sgd_epochs if sgd_epochs is not None else math.inf
    if "kfac" in args.stages:
        rows = []
        grid = itertools.product(
            args.dampings,
            args.kl_clips,
            args.intervals,
            args.factor_decays,
            args.sample_fractions,
            args.compute_methods,
        )
        for damping, kl_clip, iv, decay, fraction, method in grid:
            f, d = (int(v) for v in iv.split(":"))
            opts = {"damping": damping, "kl_clip": kl_clip, "factor_update_freq": f, "inv_update_freq": d,
                    "factor_decay": decay, "conv_input_sample_fraction": fraction,
                    "compute_method": method}  # fmt: skip
            rows.append(tune("kfac", "kfac", kfac_lr, opts))
        best = _best(rows, args.select, cap)
        kfac = {k: best[k] for k in kfac}
    if "lr2" in args.stages:
        kfac_lr = _best([tune("lr2", "kfac", lr, kfac) for lr in args.lrs], args.select, cap)["lr"]
    if sweep.rows:
        sweep.print()
        sweep.write()
    if "final" not in args.stages:
        return

    report = Report("kfac_convergence" + args.tag)
    report.meta.update(vars(args), chosen_sgd_lr=sgd_lr, chosen_kfac_lr=kfac_lr, chosen_adam_lr=adam_lr,
                       chosen_kfac=kfac,
                       note="shared 2-core machine: wall times are noisy; CPU time (one thread) is the step's own work")
    for method, lr, opts in (("sgd", sgd_lr, {}), ("kfac", kfac_lr, kfac), ("adam", adam_lr, {})):
        row = report.add(**evaluate_config(method, lr, opts, args.seeds, args.max_epochs, args))
        print(row, flush=True)
    report.add_ratios("method", "median_epochs", "sgd", ratio_name="epochs_vs_sgd")
    report.add_ratios("method", "median_seconds", "sgd", ratio_name="wall_time_vs_sgd")
    report.add_ratios("method", "median_cpu_seconds", "sgd", ratio_name="cpu_time_vs_sgd")
    report.print()
    report.write()
    report.plot_bars(
        "method",
        "median_epochs",
        title=f"Epochs to {args.target:.0%} val acc (digits {args.model}, median of {len(args.seeds)} seeds)",
        ylabel="epochs",
    )


if __name__ == "__main__":
    main()

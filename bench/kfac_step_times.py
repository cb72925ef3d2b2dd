"""Per-step cost of SGD and SGD + K-FAC on the digits CNN of ``kfac_convergence.py`` (same model, batch, settings).

Fresh model per seed, one epoch each, one thread (``--threads`` for more, the same for both); prints the median
training-step time of SGD, of K-FAC steps
that update only the factors and of steps that also decompose them, and the amortized K-FAC step over SGD.
Explains the wall-time ratio of the convergence benchmark: epochs x steps per epoch x this cost.

    python bench/kfac_step_times.py [--damping 0.003 --kl-clip 0.001 --factor-every 1 --decomp-every 5]
    [--sample-fraction 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from harness import Report
from torch.utils.data import DataLoader

from lightning_hpc.data.digits import load_digits_tensors
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.models import small_cnn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument("--kl-clip", type=float, default=0.001)
    ap.add_argument("--factor-every", type=int, default=1)
    ap.add_argument("--decomp-every", type=int, default=5)
    ap.add_argument("--factor-decay", type=float, default=0.95)
    ap.add_argument(
        "--sample-fraction",
        type=float,
        default=1.0,
        help="conv_input_sample_fraction (optional variant; 1.0 = default)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the same for both methods)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, _ = load_digits_tensors(0.2, seed=0)
    times: dict[str, list[float]] = {"sgd": [], "kfac_factor_step": [], "kfac_decomposition_step": [], "kfac_all": []}
    for seed in args.seeds:
        for method in ("sgd", "kfac"):
            torch.manual_seed(seed)
            model = small_cnn(1, 10)
            opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
            pre = None
            if method == "kfac":
                pre = KFACPreconditioner(
                    model,
                    optimizer=opt,
                    damping=args.damping,
                    kl_clip=args.kl_clip,
                    factor_update_freq=args.factor_every,
                    inv_update_freq=args.decomp_every,
                    factor_decay=args.factor_decay,
                    conv_input_sample_fraction=args.sample_fraction,
                )
            loader = DataLoader(
                train,
                batch_size=args.batch,
                shuffle=True,
                drop_last=True,
                generator=torch.Generator().manual_seed(seed),
            )
            for x, y in loader:
                decomp = pre is not None and pre.is_inv_update_step
                t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if pre is not None:
                    pre.step()
                opt.step()
                ms = (time.perf_counter() - t0) * 1e3
                if pre is None:
                    times["sgd"].append(ms)
                else:
                    times["kfac_all"].append(ms)
                    times["kfac_decomposition_step" if decomp else "kfac_factor_step"].append(ms)
    report = Report("kfac_step_times" + args.tag)
    report.meta.update(
        vars(args), note=f"{args.threads} thread(s), digits CNN (small_cnn), one epoch per seed, first steps included"
    )
    for name, ts in times.items():
        report.add(step=name, steps=len(ts), median_ms=statistics.median(ts), mean_ms=statistics.fmean(ts))
    report.add_ratios("step", "median_ms", "sgd", ratio_name="median_vs_sgd")
    report.add_ratios("step", "mean_ms", "sgd", ratio_name="mean_vs_sgd")
    report.print()
    report.write()


if __name__ == "__main__":
    main()

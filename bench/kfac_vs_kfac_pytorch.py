"""K-FAC side by side with kfac-pytorch on the CPU: the amortized optimizer step over plain SGD's on the same model,
data and schedule, in one process.

Each configuration trains its own copy of one model for ``--window`` consecutive steps (after 5 warm-up steps)
and is timed as a whole, so the window holds the schedule itself: with factors every 10 steps and
decompositions every 100 (the defaults), a window of 100 steps holds 10 factor updates and one decomposition,
exactly the amortized step. The configurations alternate over ``--rounds`` rounds (they see the same machine
state); the median per configuration is reported against SGD's in the same run. Process CPU time at one thread
(wall time is reported too).

* ``sgd``: forward, backward, ``SGD.step`` (momentum 0.9);
* ``lightning_hpc``: + :class:`lightning_hpc.kfac.KFACPreconditioner` at its defaults (every layer type it
  handles, the BatchNorm layers' per-channel blocks included);
* ``lightning_hpc_conv_linear``: the same on the layer types kfac-pytorch handles (``Conv2d``, ``Linear``);
* ``kfac_pytorch``: + kfac-pytorch's ``KFACPreconditioner`` (0.4.2: ``Conv2d`` and ``Linear``), same damping,
  KL clip, factor decay and intervals.

kfac-pytorch is not a dependency: install its wheel beside the package (``pip install --no-deps
kfac_pytorch-0.4.2-py3-none-any.whl``); without it its row says so.

    flock LOCKFILE python bench/kfac_vs_kfac_pytorch.py [--model resnet32] [--batch 128] [--window 100] \
        [--rounds 2] [--tag _2026_11_28]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Report  # noqa: E402

from lightning_hpc.kfac import KFACPreconditioner  # noqa: E402
from lightning_hpc.models import cifar_resnet  # noqa: E402

DAMPING, KL_CLIP, DECAY, LR = 0.003, 0.001, 0.95, 0.01


def _trainer(model0: nn.Module, x: torch.Tensor, y: torch.Tensor, config: str, factor_every: int,
             decomp_every: int) -> Callable[[], None]:
    model = copy.deepcopy(model0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    precondition: Callable[[], object] = lambda: None  # noqa: E731
    if config.startswith("lightning_hpc"):
        layer_types = ["linear", "conv"] if config.endswith("conv_linear") else None
        ours = KFACPreconditioner(model, optimizer=opt, factor_update_freq=factor_every, inv_update_freq=decomp_every,
                                  damping=DAMPING, kl_clip=KL_CLIP, factor_decay=DECAY, layer_types=layer_types,
                                  announce=False)
        precondition = ours.step
    elif config == "kfac_pytorch":
        import kfac  # kfac-pytorch

        theirs = kfac.preconditioner.KFACPreconditioner(
            model, factor_update_steps=factor_every, inv_update_steps=decomp_every, damping=DAMPING,
            kl_clip=KL_CLIP, factor_decay=DECAY, lr=LR)
        precondition = theirs.step

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        precondition()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["resnet32"], default="resnet32")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--window", type=int, default=100, help="consecutive steps timed per configuration and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--factor-every", type=int, default=10)
    ap.add_argument("--decomp-every", type=int, default=100)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model0 = cifar_resnet(32, num_classes=10)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    configs = ["sgd", "lightning_hpc", "lightning_hpc_conv_linear", "kfac_pytorch"]
    steps: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    for c in configs:
        try:
            steps[c] = _trainer(model0, x, y, c, args.factor_every, args.decomp_every)
            for _ in range(5):  # warm-up; the first step decomposes
                steps[c]()
        except Exception as e:  # noqa: BLE001 - kfac-pytorch not installed, or its API refused: said in the row
            errors[c] = f"not measured: {type(e).__name__}: {e}"
            steps.pop(c, None)
    cpu: dict[str, list[float]] = {c: [] for c in steps}
    wall: dict[str, list[float]] = {c: [] for c in steps}
    for _ in range(args.rounds):
        for c, step in steps.items():
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.window):
                step()
            cpu[c].append((time.process_time() - t0) / args.window)
            wall[c].append((time.perf_counter() - w0) / args.window)
    report = Report(f"kfac_vs_kfac_pytorch{args.tag}")
    report.meta.update(vars(args))
    for c in configs:
        if c in errors:
            report.add(config=c, error=errors[c])
            continue
        report.add(config=c, cpu_s_per_step=statistics.median(cpu[c]), wall_s_per_step=statistics.median(wall[c]),
                   cpu_rounds=[round(v, 4) for v in cpu[c]])
    report.add_ratios("config", "cpu_s_per_step", "sgd", ratio_name="vs_sgd")
    report.print(["config", "cpu_s_per_step", "wall_s_per_step", "vs_sgd", "cpu_rounds", "error"])
    print(f"wrote {report.write()}")


if __name__ == "__main__":
    main()

"""What K-FAC's step costs a GPU in host work, counted on a CPU: the ATen calls, the kernel-launching calls and the
host synchronisations of each step kind, beside SGD's, with the routes a GPU takes.

On a GPU the K-FAC step of ResNet-50 and of the modern CNNs is bound by kernel launches and their host work, not
by arithmetic (``bench/reports/2026-11-28-gpu-check-h200.md``: the preconditioning step adds 18-20 ms to a 68 ms
SGD step, a factor step 177-206 ms). Each ATen call that is not a view is a kernel a GPU launches (a few
microseconds of host work each, plus the launch), so the count is what stands for that cost on a machine
without a GPU; it does not depend on the machine's load, so it is also what the tests bound. The calls are
counted by a ``TorchDispatchMode`` around one step of each kind (after warm-up):

* ``sgd``: forward, backward, ``SGD.step`` (the baseline);
* ``precondition``: + ``KFACPreconditioner.step`` that only preconditions;
* ``factors``: + the factor capture and running-average update;
* ``decomp``: + every eigendecomposition (``--decomp``; slow on a CPU for ResNet-50's 4,608-square factors);
  ``decompositions_*`` are its counts beyond the factor step's: the decompositions alone (the solvers, their
  checks, the preconditioning buckets' restacked decompositions).

``--host N`` measures the host work of the precondition-only step instead: the Python function calls of one
``KFACPreconditioner.step`` (``cProfile``: Python functions and the builtins and torch functions they call, per
preconditioned layer; a count, as deterministic as the launches) and its process CPU time at one thread, the median
of ``N`` calls on the same gradients (restored before each call, untimed). At a tiny input (``--size 32 --batch 2``)
the step's kernels are cheap, so that time is mostly the Python a GPU's host runs for it.

``--routes accelerator`` (default) counts the routes a GPU takes (:func:`lightning_hpc.kfac.linalg.accelerator_routes`:
one product per Gram, no CPU cache blocking or BLAS ``syrk``); ``cpu`` the CPU's. Host synchronisations are the
calls that read a value back (``.item()``, ``bool(t)``, ``nonzero``...), uploads the tensors made from host data
(``torch.tensor``, a Python number assigned into a tensor); on a GPU each waits for the queue.

    python bench/kfac_launches.py [--models resnet50 convnext efficientnet mobilenetv3] [--size 64] [--batch 8]
        [--routes accelerator|cpu] [--decomp] [--sites N] [--tag T]
    python bench/kfac_launches.py --host 50 --size 32 --batch 2 [--models ...] [--tag T]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import Report, force_kfac_step_kind
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.linalg import accelerator_routes
from lightning_hpc.models import cifar_resnet, resnet50
from lightning_hpc.models.modern_cnns import convnext, efficientnet, mobilenetv3

#: ATen calls that make no kernel: views and metadata (a GPU launches nothing for them)
NO_KERNEL = frozenset({
    "alias", "as_strided", "detach", "diagonal", "expand", "lift_fresh", "narrow", "permute", "promote_types",
    "result_type", "select", "slice", "split", "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold",
    "unsqueeze", "view", "_reshape_alias", "_unsafe_view", "view_as_real", "view_as_complex", "_to_copy_noop",
})
#: ATen calls that read a value back to the host (a synchronisation on a GPU)
HOST_SYNC = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item"})
#: ATen calls that make a tensor from host data (``torch.tensor(...)``, indexing assignment of a Python number): on a
#: GPU an upload from pageable memory, which waits for the queue like a read-back
HOST_UPLOAD = frozenset({"lift_fresh"})

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet50": lambda width, classes: resnet50(num_classes=classes),
    "convnext": lambda width, classes: convnext(num_classes=classes),
    "efficientnet": lambda width, classes: efficientnet(num_classes=classes, width=width),
    "mobilenetv3": lambda width, classes: mobilenetv3(num_classes=classes, width=width),
    "resnet32": lambda width, classes: cifar_resnet(32, num_classes=classes),
}


class CallCounter(TorchDispatchMode):
    """Counts the ATen calls under it: all, kernel-launching, host-synchronising; with ``sites``, the launching
    calls by the innermost ``lightning_hpc`` function that made them."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.calls = self.launches = self.syncs = self.uploads = 0
        self.sites: collections.Counter[str] | None = collections.Counter() if sites else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        self.calls += 1
        if name not in NO_KERNEL:
            self.launches += 1
            if self.sites is not None:
                stack = traceback.extract_stack(limit=40)
                site = next((f"{f.filename.rsplit('lightning_hpc/', 1)[-1]}:{f.name}" for f in reversed(stack)
                             if "lightning_hpc/" in f.filename), "torch")
                self.sites[f"{site} {name}"] += 1
        if name in HOST_SYNC:
            self.syncs += 1
        if name in HOST_UPLOAD:
            self.uploads += 1
        return func(*args, **(kwargs or {}))


def _setup(model_name: str, size: int, batch: int, model: nn.Module | None, width: float,
           classes: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.optim.Optimizer, KFACPreconditioner]:
    """``MODELS[model_name]`` (or ``model``), a batch of ``batch`` inputs of ``size``^2, SGD and K-FAC."""
    torch.manual_seed(0)
    model = model if model is not None else MODELS[model_name](width, classes)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, classes, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, damping=0.003,
                             announce=False)
    return model, x, y, opt, pre


def count(model_name: str, size: int, batch: int, decomp: bool, sites: int,
          model: nn.Module | None = None, width: float = 1.0, classes: int = 1000) -> dict[str, Any]:
    """The counts of one step of each kind on ``MODELS[model_name]`` (or ``model``), at ``size``^2, ``batch``."""
    model, x, y, opt, pre = _setup(model_name, size, batch, model, width, classes)

    def step(kfac: bool, factors: bool, decompose: bool) -> None:
        force_kfac_step_kind(pre, factors, decompose)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if kfac:
            pre.step()
        opt.step()

    kinds = {"sgd": (False, False, False), "precondition": (True, False, False), "factors": (True, True, False)}
    if decomp:
        kinds["decomp"] = (True, True, True)
    step(True, True, True)  # factors and decompositions exist
    row: dict[str, Any] = {"model": model_name, "size": size, "batch": batch,
                           "layers": len(pre.preconditioned_modules)}
    for kind, flags in kinds.items():
        step(*flags)  # warm-up: caches (decisions, stacks) as in a steady run
        with CallCounter(sites=sites > 0) as c:
            step(*flags)
        row[f"{kind}_calls"], row[f"{kind}_launches"], row[f"{kind}_syncs"] = c.calls, c.launches, c.syncs
        row[f"{kind}_uploads"] = c.uploads
        if c.sites is not None and kind != "sgd":
            row[f"{kind}_sites"] = dict(c.sites.most_common(sites))
    for kind in kinds:
        if kind != "sgd":
            row[f"{kind}_added_launches"] = row[f"{kind}_launches"] - row["sgd_launches"]
            row[f"{kind}_added_per_layer"] = row[f"{kind}_added_launches"] / max(row["layers"], 1)
            row[f"{kind}_launches_vs_sgd"] = row[f"{kind}_launches"] / row["sgd_launches"]
    if decomp:  # the decompositions alone: the decomposing step beyond a factor step
        for what in ("launches", "syncs"):
            row[f"decompositions_{what}"] = row[f"decomp_{what}"] - row[f"factors_{what}"]
        row["decompositions_launches_per_layer"] = row["decompositions_launches"] / max(row["layers"], 1)
    return row | precondition_host(model, x, y, opt, pre, 0)


def host_work(model_name: str, size: int, batch: int, repeats: int,
              model: nn.Module | None = None, width: float = 1.0, classes: int = 1000) -> dict[str, Any]:
    """The host work of one precondition-only ``KFACPreconditioner.step`` on ``MODELS[model_name]`` (or ``model``)
    at ``size``^2, ``batch`` (:func:`precondition_host`)."""
    model, x, y, opt, pre = _setup(model_name, size, batch, model, width, classes)
    force_kfac_step_kind(pre, True, True)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    pre.step()  # factors and decompositions exist
    row: dict[str, Any] = {"model": model_name, "width": width, "classes": classes, "size": size, "batch": batch}
    return row | precondition_host(model, x, y, opt, pre, repeats)


def precondition_host(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer,
                      pre: KFACPreconditioner, repeats: int) -> dict[str, Any]:
    """Python function calls per preconditioned layer of one ``pre.step()`` that only preconditions (``cProfile``,
    after warm-up; ``pre`` has decompositions), and with ``repeats`` the step's median process CPU time in ms (the
    KL clip on, as by default; the gradients restored before each call, untimed)."""
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grads = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in grads]

    def precondition() -> None:
        for p, g in zip(grads, saved):
            p.grad.copy_(g)
        force_kfac_step_kind(pre, False, False)

    for _ in range(3):  # warm-up: caches (decisions, stacks) as in a steady run
        precondition()
        pre.step()
    precondition()
    profile = cProfile.Profile()
    profile.runcall(pre.step)
    calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    layers = len(pre.preconditioned_modules)
    row: dict[str, Any] = {"layers": layers, "precondition_python_calls": calls,
                           "precondition_python_calls_per_layer": calls / layers}
    times = []
    for _ in range(repeats):
        precondition()
        t0 = time.process_time()
        pre.step()
        times.append(time.process_time() - t0)
    if times:
        row["precondition_host_ms"] = statistics.median(times) * 1e3
        row["precondition_host_us_per_layer"] = row["precondition_host_ms"] * 1e3 / layers
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=[m for m in MODELS if m != "resnet32"])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--routes", choices=["accelerator", "cpu"], default="accelerator")
    ap.add_argument("--decomp", action="store_true", help="also count the decomposing step (slow for ResNet-50)")
    ap.add_argument("--sites", type=int, default=0, help="list the N call sites that launch the most")
    ap.add_argument("--width", type=float, default=1.0, help="channel multiplier of the EfficientNet- and "
                    "MobileNetV3-style nets (narrower: cheaper kernels, the same layers)")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="measure the precondition-only step's Python calls and host time (median of N) instead")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = Report("kfac_launches" + (f"_{args.tag}" if args.tag else ""), meta=dict(vars(args)))
    routes = accelerator_routes() if args.routes == "accelerator" else contextlib.nullcontext()
    with routes:
        for name in args.models:
            row = (host_work(name, args.size, args.batch, args.host, width=args.width, classes=args.classes)
                   if args.host else count(name, args.size, args.batch, args.decomp, args.sites, width=args.width,
                                           classes=args.classes))
            report.add(**{k: v for k, v in row.items() if not k.endswith("sites")})
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("sites")},
                  flush=True)
            for k, v in row.items():
                if k.endswith("sites"):
                    print(f"  {k}:")
                    for site, n in v.items():
                        print(f"    {n:6d} {site}")
    if args.tag:
        print(f"written: {report.write()}")


if __name__ == "__main__":
    main()

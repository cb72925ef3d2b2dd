"""The first GPU figures: each a ratio against a baseline timed in the same run, with the absolute times.

1. ``kfac``: K-FAC's amortized optimizer step over SGD's on ResNet-50 and the ConvNeXt-, EfficientNet- and
   MobileNetV3-style nets (``lightning_hpc.models``; ImageNet shapes, batch 64), factors every 10 steps and
   eigendecompositions every 100: 100 consecutive steps timed after 5 warm-up steps (the window holds 10 factor
   updates and one decomposition, exactly the amortized schedule), beside kfac-pytorch 0.4.2 on the same model and
   schedule when it is importable (``import kfac``).
2. ``kfac_parts``: the same figure split into its parts, on ResNet-50 and the ConvNeXt-, EfficientNet- and
   MobileNetV3-style nets (``lightning_hpc.models``) at 224^2: the step that only preconditions, the step that also
   updates the factors (their products), the step that also decomposes, each against SGD's step in the same
   interleaved rounds; the host synchronisations each step kind makes (``torch.cuda.set_sync_debug_mode``); the
   amortized ratio at factors /10 and decompositions /100 from the parts.
3. ``multigrid``: single-device multigrid forward (2 cycles) with each relaxation batched across the layers of a
   level, and the same solver evaluating the layers one after the other, over the serial forward (the seed
   paper's "GPU concurrency"); ODE-ResNets of 256 and 1,024 steps.
4. ``spatial``: the op-dispatch overhead on the GPU: a training step of the mesh-tangling FCN at 1K on a split
   activation over one tile (every op through the handlers and tile kernels) over the same step on plain tensors,
   and over the plain step compiled (``torch.compile``): a split model runs its compiled code eagerly, so the
   compiled plain step is what a split step is held against. Also the host's own time per step (from the call to
   its return, the device drained before) and the host synchronisations per step of the split and the plain
   step: an overhead with the same synchronisations is host work exposed, one with more is host waits. The halo
   exchange itself needs two GPUs and NCCL: it is not timed on one GPU.

Times are CUDA-event medians (synchronised), TF32 off (float32 is float32).  Writes one JSON file.

    python bench/gpu_figures.py --out gpu_figures.json [--only kfac kfac_parts multigrid spatial] [--steps 100]

``--smoke`` runs every figure on the CPU at toy sizes (small nets, 32^2 images, batch 2, 2 steps, one round; the
spatial step at 128^2 with torch.compile's ``eager`` backend) and says so in the file: its numbers are not
figures. A test runs it (``tests/test_gpu_figures_smoke.py``), so the script that runs on a GPU machine, with
little time on it, has run end to end before it gets there.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


#: where the figures run: "cuda", or "cpu" under ``--smoke``
DEVICE = "cuda"
#: the K-FAC figures' image side (ImageNet's; 32 under ``--smoke``)
IMAGE_SIZE = 224
#: torch.compile's backend for the spatial figure's compiled steps (``eager`` under ``--smoke``: the wiring, not
#: inductor's code generation)
COMPILE_BACKEND = "inductor"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` on the current CUDA device, one CUDA-event pair per call (wall seconds on the
    CPU under ``--smoke``)."""
    if DEVICE != "cuda":
        from harness import timeit  # bench/harness.py

        return timeit(fn, warmup=warmup, repeats=repeats).samples
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


# ----------------------------------------------------------------------------------------------------- 1. K-FAC
def builders() -> dict[str, Callable[[], nn.Module]]:
    """ResNet-50 and the three modern CNNs, ImageNet heads (under ``--smoke``: a CIFAR ResNet-8 and narrow, shallow
    nets of the same three kinds, so every code path runs in seconds on a CPU)."""
    from lightning_hpc.models import cifar_resnet, resnet50
    from lightning_hpc.models.modern_cnns import convnext, efficientnet, mobilenetv3

    if DEVICE != "cuda":
        return {
            "cifar_resnet8 (smoke)": lambda: cifar_resnet(8, num_classes=1000),
            "convnext (smoke: dims 8-64, one block per stage)":
                lambda: convnext(num_classes=1000, dims=(8, 16, 32, 64), depths=(1, 1, 1, 1)),
            "efficientnet (smoke: width 0.25)": lambda: efficientnet(num_classes=1000, width=0.25),
            "mobilenetv3 (smoke: width 0.25)": lambda: mobilenetv3(num_classes=1000, width=0.25),
        }
    return {
        "resnet50": lambda: resnet50(num_classes=1000),
        "convnext": lambda: convnext(num_classes=1000),
        "efficientnet": lambda: efficientnet(num_classes=1000),
        "mobilenetv3": lambda: mobilenetv3(num_classes=1000),
    }


def kfac_all(steps: int, batch: int) -> list[dict[str, Any]]:
    rows = []
    for name, build in builders().items():
        t0 = time.perf_counter()
        try:
            rows.append(kfac_figure(name, build, steps, batch))
        except Exception:  # noqa: BLE001 - one model failing must not lose the others
            rows.append({"model": name, "error": traceback.format_exc()})
        print(f"  kfac {name} ({time.perf_counter() - t0:.0f} s): {json.dumps(rows[-1])}", flush=True)
    return rows


def kfac_figure(name: str, build: Callable[[], nn.Module], steps: int, batch: int) -> dict[str, Any]:
    from lightning_hpc.kfac import KFACPreconditioner

    device = torch.device(DEVICE)
    torch.manual_seed(0)
    model0 = build().to(device)
    x = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def trainer(precondition: Callable[[nn.Module, torch.optim.Optimizer], Callable[[], None]] | None):
        model = copy.deepcopy(model0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        pre = precondition(model, opt) if precondition is not None else (lambda: None)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            pre()
            opt.step()

        return step

    def ours(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        p = KFACPreconditioner(model, optimizer=opt, factor_update_freq=10, inv_update_freq=100, damping=0.003)
        return p.step

    def kfac_pytorch(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        import kfac  # kfac-pytorch

        p = kfac.preconditioner.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100,
                                                   damping=0.003, lr=0.01)
        return p.step

    def window(step: Callable[[], None]) -> float:
        """Seconds per step over ``steps`` consecutive steps after 5 warm-up steps (step 0 decomposes)."""
        for _ in range(5):
            step()
        return cuda_seconds(lambda: [step() for _ in range(steps)], repeats=1, warmup=0)[0] / steps

    result: dict[str, Any] = {"model": name, "batch": batch, "factor_every": 10, "decomp_every": 100,
                              "steps_timed": steps}
    result["sgd_s_per_step"] = window(trainer(None))
    result["kfac_s_per_step"] = window(trainer(ours))
    result["kfac_vs_sgd"] = result["kfac_s_per_step"] / result["sgd_s_per_step"]
    if DEVICE != "cuda" and name != next(iter(builders())):
        # (kfac-pytorch takes minutes on the CPU for the smoke EfficientNet's 131 layers)
        result["kfac_pytorch"] = "not measured: --smoke runs kfac-pytorch on its first net only"
        return result
    try:
        result["kfac_pytorch_s_per_step"] = window(trainer(kfac_pytorch))
        result["kfac_pytorch_vs_sgd"] = result["kfac_pytorch_s_per_step"] / result["sgd_s_per_step"]
    except Exception as e:  # noqa: BLE001 - not installed here, or its API refused: said in the figures
        result["kfac_pytorch"] = f"not measured: {type(e).__name__}: {e}"
    return result


# ----------------------------------------------------------------------------------------------- 2. K-FAC parts
def host_syncs(fn: Callable[[], Any]) -> int:
    """The host synchronisations one call of ``fn`` makes (each a warning of torch's sync debug mode); -1 on the
    CPU (``--smoke``), which has none to count."""
    if DEVICE != "cuda":
        fn()
        return -1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)


def kfac_parts_figure(name: str, build: Callable[[], nn.Module], batch: int, size: int, classes: int,
                      rounds: int) -> dict[str, Any]:
    """Median CUDA seconds of each step kind over ``rounds`` interleaved rounds (the decomposing step in at most
    3 of them: it is the long one), the parts as differences, and the amortized ratio at f=10, d=100."""
    from harness import force_kfac_step_kind  # bench/harness.py

    from lightning_hpc.kfac import KFACPreconditioner

    torch.manual_seed(0)
    model0 = build().to(DEVICE)
    x = torch.randn(batch, 3, size, size, device=DEVICE)
    y = torch.randint(0, classes, (batch,), device=DEVICE)
    sgd_model = copy.deepcopy(model0)
    sgd_opt = torch.optim.SGD(sgd_model.parameters(), lr=0.01, momentum=0.9)
    model = copy.deepcopy(model0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, damping=0.003,
                             announce=False)

    def sgd() -> None:
        sgd_opt.zero_grad(set_to_none=True)
        F.cross_entropy(sgd_model(x), y).backward()
        sgd_opt.step()

    def kfac_step(factors: bool, decomp: bool) -> None:
        force_kfac_step_kind(pre, factors, decomp)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()

    kinds: dict[str, Callable[[], None]] = {
        "sgd": sgd,
        "precondition": lambda: kfac_step(False, False),
        "factors": lambda: kfac_step(True, False),
        "factors_decomp": lambda: kfac_step(True, True),
    }
    kfac_step(True, True)  # factors and decompositions exist before the precondition-only steps
    for fn in kinds.values():
        fn()
    syncs = {k: host_syncs(fn) for k, fn in kinds.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k, fn in kinds.items():
            if k == "factors_decomp" and r >= 3:
                continue
            times[k] += cuda_seconds(fn, repeats=1, warmup=0)
    t = {k: statistics.median(v) for k, v in times.items()}
    f, d = 10, 100
    amortized = (t["factors_decomp"] + (d // f - 1) * t["factors"] + (d - d // f) * t["precondition"]) / d
    return {
        "model": name, "batch": batch, "size": size, "rounds": rounds,
        "layers_preconditioned": len(pre.preconditioned_modules),
        **{f"{k}_s": v for k, v in t.items()},
        "preconditioning_per_step_s": t["precondition"] - t["sgd"],
        "factor_products_s": t["factors"] - t["precondition"],
        "decompositions_s": t["factors_decomp"] - t["factors"],
        "host_syncs_per_step": syncs,
        "precondition_vs_sgd": t["precondition"] / t["sgd"],
        "factors_vs_sgd": t["factors"] / t["sgd"],
        "factors_decomp_vs_sgd": t["factors_decomp"] / t["sgd"],
        "amortized_f10_d100_vs_sgd": amortized / t["sgd"],
    }


def kfac_parts_all(batch: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for name, build in builders().items():
        t0 = time.perf_counter()
        try:
            rows.append(kfac_parts_figure(name, build, batch, IMAGE_SIZE, 1000, rounds))
        except Exception:  # noqa: BLE001 - one model failing must not lose the others
            rows.append({"model": name, "error": traceback.format_exc()})
        print(f"  kfac_parts {name} ({time.perf_counter() - t0:.0f} s): {json.dumps(rows[-1])}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- 3. multigrid
def multigrid_figure(depths: list[int], repeats: int) -> list[dict[str, Any]]:
    from multigrid import build  # bench/multigrid.py: the same nets as the CPU figures

    rows = []
    for depth in depths:
        x = torch.randn(8, 1, 8, 8, device=DEVICE)
        nets = {name: build(method, depth, None, concurrent).to(DEVICE).eval()
                for name, method, concurrent in (("serial", "serial", True), ("mg_batched", "mg", True),
                                                 ("mg_layer_by_layer", "mg", False))}
        times: dict[str, list[float]] = {name: [] for name in nets}
        with torch.no_grad():
            for _ in range(repeats):  # interleaved: the three see the same machine state
                for name, net in nets.items():
                    times[name] += cuda_seconds(lambda: net(x), repeats=1)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"depth": depth, **{f"{k}_forward_s": v for k, v in med.items()},
                     "mg_batched_vs_serial": med["mg_batched"] / med["serial"],
                     "mg_layer_by_layer_vs_serial": med["mg_layer_by_layer"] / med["serial"]})
    return rows


# --------------------------------------------------------------------------------------------------- 4. spatial
def spatial_figure(size: int, repeats: int) -> dict[str, Any]:
    """A training step of the mesh-tangling FCN on a split activation over one tile (every op through the
    handlers and tile kernels; no exchange) over the same step on plain tensors, alternated."""

    # the same steps bench/spatial_dispatch.py times on the CPU, the protocol floor among them
    from spatial_dispatch import one_tile_step, protocol_floor_step

    step, _ = one_tile_step(size, device=DEVICE)

    kinds: dict[str, Callable[[], None]] = {"plain": lambda: step(False), "dispatch": lambda: step(True),
                                            "protocol_floor": protocol_floor_step(size, device=DEVICE)}
    out: dict[str, Any] = {"model": "mesh_fcn (18 channels, 3 convs per block)", "size": size, "batch": 1}
    try:
        compiled = compiled_step(size)
        t0 = time.perf_counter()
        compiled()  # the compilation, timed apart
        out["compile_s"] = time.perf_counter() - t0
        kinds["compiled_plain"] = compiled
    except Exception:  # noqa: BLE001 - the eager figures stand without it
        out["compiled_plain"] = {"error": traceback.format_exc()}
    try:  # the split step compiled (lightning_hpc.spatial.compile): one graph of tile operations
        compiled_split = compiled_step(size, split=True)
        t0 = time.perf_counter()
        compiled_split()
        out["compile_split_s"] = time.perf_counter() - t0
        kinds["compiled_split"] = compiled_split
    except Exception:  # noqa: BLE001 - the other figures stand without it
        out["compiled_split"] = {"error": traceback.format_exc()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    host: dict[str, list[float]] = {k: [] for k in ("plain", "dispatch", "protocol_floor")}
    for _ in range(repeats):  # alternated: the kinds see the same machine state
        for k, fn in kinds.items():
            times[k] += cuda_seconds(fn, repeats=1)
        for k in host:  # the host's own time per step (launches return at once unless the host waits)
            synchronize()
            t0 = time.perf_counter()
            kinds[k]()
            host[k].append(time.perf_counter() - t0)
            synchronize()
    med = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}_s_per_step": v for k, v in med.items()})
    # where the overhead comes from: host work (exposed once it exceeds the device's) or host waits
    out.update({f"{k}_host_s_per_step": statistics.median(v) for k, v in host.items()})
    out.update({f"{k}_host_syncs_per_step": host_syncs(kinds[k]) for k in host})
    out["dispatch_overhead"] = med["dispatch"] / med["plain"] - 1.0
    # what any __torch_function__ subclass costs on this device (bench/spatial_dispatch.py's protocol floor)
    out["protocol_floor_overhead"] = med["protocol_floor"] / med["plain"] - 1.0
    if "compiled_plain" in med:
        out["dispatch_vs_compiled_plain"] = med["dispatch"] / med["compiled_plain"]
        out["compiled_plain_vs_plain"] = med["compiled_plain"] / med["plain"]
    if "compiled_split" in med and "compiled_plain" in med:
        out["compiled_split_vs_compiled_plain"] = med["compiled_split"] / med["compiled_plain"]
    return out


def compiled_step(size: int, split: bool = False) -> Callable[[], None]:
    """The plain step of :func:`spatial_figure` with the network under ``torch.compile`` (its own copy);
    ``split``: on a split activation over one tile, the compiled module's forward as the spatial strategy runs it
    (:class:`~lightning_hpc.spatial.compile.SplitCompiledForward`)."""
    from lightning_hpc.models import mesh_fcn
    from lightning_hpc.spatial.compile import SplitCompiledForward
    from lightning_hpc.spatial.dispatch import split_tensor
    from lightning_hpc.spatial.layout.tiling import SpatialGrid

    torch.manual_seed(0)
    net = mesh_fcn(in_channels=18, convs_per_block=3).to(DEVICE)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    fast: Callable[[torch.Tensor], torch.Tensor] = torch.compile(net, backend=COMPILE_BACKEND)
    x = torch.randn(1, 18, size, size, device=DEVICE)
    y = (torch.rand(1, 1, size, size, device=DEVICE) > 0.5).float()
    if split:
        grid = SpatialGrid.single()
        fast = SplitCompiledForward(fast)
        x, y = split_tensor(x, grid, tuple(x.shape)), split_tensor(y, grid, tuple(y.shape))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(fast(x), y).backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_figures.json"))
    ap.add_argument("--only", nargs="+", choices=["kfac", "kfac_parts", "multigrid", "spatial"],
                    default=["kfac", "kfac_parts", "multigrid", "spatial"])
    ap.add_argument("--rounds", type=int, default=7, help="kfac_parts: interleaved rounds per step kind")
    ap.add_argument("--steps", type=int, default=100, help="K-FAC: consecutive steps timed (a multiple of 100)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--smoke", action="store_true",
                    help="every figure on the CPU at toy sizes: a run of the script, not figures")
    args = ap.parse_args()
    global DEVICE, IMAGE_SIZE, COMPILE_BACKEND
    sizes = {"mg_depths": [256, 1024], "mg_repeats": 7, "spatial_size": 1024, "spatial_repeats": 10}
    if args.smoke:
        DEVICE, IMAGE_SIZE, COMPILE_BACKEND = "cpu", 32, "eager"
        args.steps, args.rounds, args.batch = 2, 1, 2
        sizes = {"mg_depths": [16], "mg_repeats": 1, "spatial_size": 128, "spatial_repeats": 2}
    elif not torch.cuda.is_available():
        sys.exit("bench/gpu_figures.py needs a CUDA device (--smoke runs it on the CPU at toy sizes)")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    figures: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (--smoke: not figures)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
    runs: dict[str, Callable[[], Any]] = {
        "kfac": lambda: kfac_all(args.steps, args.batch),
        "kfac_parts": lambda: kfac_parts_all(args.batch, args.rounds),
        "multigrid": lambda: multigrid_figure(sizes["mg_depths"], repeats=sizes["mg_repeats"]),
        "spatial": lambda: spatial_figure(sizes["spatial_size"], repeats=sizes["spatial_repeats"]),
    }
    for name in args.only:
        t0 = time.perf_counter()
        try:
            figures[name] = runs[name]()
        except Exception:  # noqa: BLE001 - one figure failing must not lose the others
            figures[name] = {"error": traceback.format_exc()}
        print(f"{name} ({time.perf_counter() - t0:.0f} s): {json.dumps(figures[name], indent=1)}", flush=True)
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

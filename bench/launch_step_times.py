"""Step time of each strategy launched the normal ways, with the launcher's default torch threads, against DDP.

Every case is a fresh 2-process job: ``python`` (Lightning's own subprocess launcher), ``torchrun --nproc_per_node
2`` or ``horovodrun -np 2``; no thread count is forced (the launcher's default applies: Lightning and torchrun
give each rank cpus // 2 threads; horovodrun sets nothing, the strategy does).  The baseline is
``strategy="ddp"`` on the same model, launched the same way (torchrun for the Horovod case), in the same run.
Each rank also records the dataset indices it read, to check the sharding (disjoint for data parallelism,
identical within a spatial group or a layer chain).  ``vs_ddp`` is a ratio of step times, not of throughput:
with 2 ranks, spatial and multigrid process one batch per step on the pair where DDP processes two, and multigrid
does more work per step by design (relaxation sweeps).

    python bench/launch_step_times.py [--steps 20] [--cases horovod layered_sgd ...] [--kfac]

Writes bench/results/launch_step_times[_kfac].{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: strategy -> (model, launcher); each is compared with ddp on the same model and launcher
CASES = {
    "layered_sgd": ("cnn", "script"),
    "spatial": ("cnn", "script"),
    "hybrid_fc": ("fc", "script"),
    "multigrid": ("ode", "script"),
    "horovod": ("cnn", "horovodrun"),
    "layered_sgd@torchrun": ("cnn", "torchrun"),
}


# ---------------------------------------------------------------------------------------------- worker (one rank)
def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch import nn

    from lightning_hpc import KFAC, ImageClassifier
    from lightning_hpc.models import ode_resnet

    seen: list[int] = []
    size = 16 if args.model == "ode" else 32

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(4096, 3, size, size, generator=g), torch.randint(0, 10, (4096,), generator=g)

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int):
            seen.append(int(i))
            return self.x[i], self.y[i]

    torch.manual_seed(0)
    if args.model == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(1), nn.Linear(64, 10))
    elif args.model == "fc":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(1),
            nn.Linear(16 * 64, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )
    else:
        model = ode_resnet(in_channels=3, input_size=(size, size), width=16, num_steps=16)
    strategy: object = args.strategy
    if args.strategy == "spatial":
        from lightning_hpc import SpatialParallelStrategy

        strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    elif args.strategy == "multigrid":
        from lightning_hpc import MultigridStrategy

        strategy = MultigridStrategy(layer_parallel_size=2)
    elif args.strategy == "layered_sgd":
        from lightning_hpc import LayeredSGDStrategy

        strategy = LayeredSGDStrategy(procs_per_node=1)  # two one-rank "nodes": the leader layer is exercised too

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *_: object) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *_: object) -> None:
            self.times.append(time.perf_counter() - self.t0)

    timer = StepTimes()
    callbacks = [timer] + ([KFAC(factor_update_freq=1, inv_update_freq=4, damping=0.01)] if args.kfac else [])
    module = ImageClassifier(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), num_classes=10)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    batch = 16 if args.model == "ode" else 32
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(Data(), batch_size=batch, shuffle=False))
    out = Path(args.worker_out) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "times": timer.times, "seen": seen}))


# ---------------------------------------------------------------------------------------------- driver
def launch(strategy: str, model: str, launcher: str, steps: int, kfac: bool, out: Path) -> dict:
    script = [str(Path(__file__).resolve()), "--worker-out", str(out), "--strategy", strategy, "--model", model,
              "--steps", str(steps)] + (["--kfac"] if kfac else [])
    if launcher == "script":
        cmd = [sys.executable, *script]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *script]
    else:
        horovodrun = Path(sysconfig.get_path("scripts")) / "horovodrun"  # next to this interpreter
        cmd = [str(horovodrun), "-np", "2", "--gloo", sys.executable, *script]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    seen = [set(r["seen"]) for r in ranks]
    return {
        "step_s": statistics.median(ranks[0]["times"][3:]),  # the first steps warm up
        "threads": ranks[0]["threads"],
        "shared_samples": len(seen[0] & seen[1]),
        "samples_per_rank": len(seen[0]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--kfac", action="store_true", help="add the KFAC callback to every run (baseline included)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    from harness import Report

    report = Report("launch_step_times" + ("_kfac" if args.kfac else ""), meta={"steps": args.steps, "kfac": args.kfac})
    baselines: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            if args.kfac and case.startswith("multigrid"):
                print("skipping multigrid with --kfac: KFAC refuses the layer-parallel multigrid trunk")
                continue
            model, launcher = CASES[case]
            strategy = case.split("@")[0]
            base_launcher = "torchrun" if launcher == "horovodrun" else launcher
            if (model, base_launcher) not in baselines:
                out = Path(tmp, f"ddp_{model}_{base_launcher}")
                out.mkdir()
                baselines[model, base_launcher] = launch("ddp", model, base_launcher, args.steps, args.kfac, out)
                report.add(case=f"ddp ({model})", launcher=base_launcher, **baselines[model, base_launcher])
            out = Path(tmp, case.replace("@", "_"))
            out.mkdir()
            row = report.add(
                case=case, launcher=launcher, **launch(strategy, model, launcher, args.steps, args.kfac, out)
            )
            row["vs_ddp"] = row["step_s"] / baselines[model, base_launcher]["step_s"]
    report.print(["case", "launcher", "threads", "step_s", "vs_ddp", "samples_per_rank", "shared_samples"])
    print("wrote", report.write())


if __name__ == "__main__":
    main()

"""Train ImageClassifier(small_cnn) on digits for a few steps and dump what each rank ended with.

Run under ``horovodrun -np 2 --gloo python train_digits.py OUT --strategy horovod`` or as
``python train_digits.py OUT --strategy ddp`` (Lightning launches the second DDP process itself).  Every rank
writes ``OUT/rank{r}.pt``: final parameters and buffers, the dataset indices it read, logged metrics, the
number of checkpoint writes it did, the torch threads it trained with.  The tests compare horovod against ddp.
``run_cases.py`` calls :func:`main` with the same arguments to share a launch with other cases.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.distributed import _num_cpus_available
from torch.utils.data import Dataset

from lightning_hpc import ImageClassifier
from lightning_hpc.data import DigitsDataModule
from lightning_hpc.models import small_cnn


class IndexRecording(Dataset):
    """Wraps a dataset and records every index read (num_workers=0: reads happen in this process)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.seen = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.seen.append(int(index))
        return self.dataset[index]


class RecordingDigits(DigitsDataModule):
    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not isinstance(self.train_set, IndexRecording):
            self.train_set = IndexRecording(self.train_set)


class CountingCheckpointIO(TorchCheckpointIO):
    """Counts the checkpoint files this process writes."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class ThreadsAtFirstBatch(pl.Callback):
    """The torch threads this rank trains with (the strategy sets them in its setup), and what they are a share of."""

    def __init__(self) -> None:
        self.threads: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.threads:
            local = int(os.environ.get("HOROVOD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
            self.threads = {"threads": torch.get_num_threads(), "cpus": _num_cpus_available(), "local": local}


def step_lr(optimizer: torch.optim.Optimizer, steps_per_epoch: float) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="horovod")
    parser.add_argument("--devices", default="2")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hvd-options", default="{}", help="HorovodStrategy keyword arguments, as JSON")
    parser.add_argument("--kfac", action="store_true", help="add the K-FAC callback (communicator='auto')")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("LOCAL_RANK", 0)))
    pl.seed_everything(0, workers=True)
    # different initial weights on each rank: the strategy must start every rank from rank 0's
    torch.manual_seed(100 + rank)
    model = ImageClassifier(
        small_cnn(1, 10),
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
        scheduler=step_lr,
    )
    data = RecordingDigits(batch_size=16)
    io = CountingCheckpointIO()
    threads = ThreadsAtFirstBatch()
    callbacks: list[pl.Callback] = [
        pl.callbacks.ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, save_top_k=0), threads
    ]
    kfac = None
    if args.kfac:
        from lightning_hpc import KFAC

        kfac = KFAC(factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01)
        callbacks.append(kfac)
    strategy = args.strategy
    if strategy == "horovod":
        from lightning_hpc import HorovodStrategy

        strategy = HorovodStrategy(**json.loads(args.hvd_options))
    elif strategy == "ddp_under_horovodrun":
        # Lightning's DDP, processes started by horovodrun, torch.distributed rendezvous through Horovod
        from lightning.pytorch.strategies import DDPStrategy

        from lightning_hpc.horovod.environment import HorovodEnvironment

        strategy = DDPStrategy(cluster_environment=HorovodEnvironment())
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        limit_train_batches=args.batches,
        limit_val_batches=3,
        num_sanity_val_steps=0,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[io],
        default_root_dir=args.out,
    )
    trainer.fit(model, datamodule=data)
    strategy = trainer.strategy
    optimizer = trainer.optimizers[0]
    hvd_optimizer = {
        "compression": type(getattr(optimizer, "_compression", None)).__name__
        if not isinstance(getattr(optimizer, "_compression", None), type)
        else optimizer._compression.__name__,
        "groups": getattr(optimizer, "_groups", None),
        "backward_passes_per_step": getattr(optimizer, "backward_passes_per_step", None),
        "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD"),
        "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rank": strategy.global_rank,
            "world_size": strategy.world_size,
            "strategy": type(strategy).__name__,
            "sampler_kwargs": strategy.distributed_sampler_kwargs,
            "params": {k: v.detach().clone() for k, v in model.model.named_parameters()},
            "buffers": {k: v.detach().clone() for k, v in model.model.named_buffers()},
            "seen": data.train_set.seen,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "saves": io.saves,
            "threads": threads.threads,
            "hvd_optimizer": hvd_optimizer,
            "kfac_comm": type(kfac.preconditioner.comm).__name__ if kfac is not None else None,
            "global_step": trainer.global_step,
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "reduced_rank_sum": float(strategy.reduce(torch.tensor(float(strategy.global_rank)), reduce_op="sum")),
            "gathered": strategy.all_gather(torch.tensor([float(strategy.global_rank)])).flatten().tolist(),
            "broadcast": strategy.broadcast({"from": strategy.global_rank}, src=1),
        },
        args.out / f"rank{strategy.global_rank}.pt",
    )


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main()

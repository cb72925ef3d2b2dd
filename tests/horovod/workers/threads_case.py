"""One short ``Trainer(strategy="horovod")`` fit; saves the torch threads each rank trained with.

Run by run_cases.py as the first case of a launch WITHOUT OMP_NUM_THREADS or with one the user chose (the other
Horovod workers force one thread, which hid that the strategy left every rank at torch's default of all cores).
Writes OUT/rank{r}.pt: ``threads``, ``cpus`` (Lightning's count of this process's CPUs), ``local`` (ranks on the node).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _num_cpus_available
from lightning.pytorch.callbacks import Callback

from lightning_hpc import ImageClassifier


class Report(Callback):
    def __init__(self) -> None:
        self.threads: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.threads = {"threads": torch.get_num_threads(), "cpus": _num_cpus_available(),
                            "local": int(os.environ["HOROVOD_LOCAL_SIZE"])}


def main(out: Path) -> None:
    ds = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    model = ImageClassifier(
        torch.nn.Sequential(torch.nn.Linear(4, 2)), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_classes=2
    )
    report = Report()
    trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[report])
    trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=2))
    torch.save(report.threads, out / f"rank{trainer.global_rank}.pt")

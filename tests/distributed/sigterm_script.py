"""A training run a test ends with SIGTERM (test_sigterm.py): ``python sigterm_script.py STRATEGY OUTDIR``.

Lightning starts the second rank itself (``devices=2``, its subprocess launcher), as a user's script does.  Each
rank writes its pid to ``OUTDIR/pid<rank>`` and, after every optimizer step, the step to ``OUTDIR/step<rank>``;
the epoch is long enough (and slowed per batch) that the signal always arrives mid-epoch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpc  # noqa: F401 - registers the strategy names
from lightning_hpc import ImageClassifier
from lightning_hpc.models import ode_resnet, small_cnn


class Progress(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        (self.out / f"step{trainer.global_rank}").write_text(str(trainer.global_step))
        time.sleep(0.05)  # a batch takes long enough that the run is always mid-epoch when signalled


def main(strategy: str, out: Path) -> None:
    torch.set_num_threads(1)
    model = ode_resnet(num_steps=8, width=4) if strategy == "multigrid" else small_cnn(width=8, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 1, 8, 8, generator=g), torch.randint(0, 10, (4096,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, callbacks=[Progress(out)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=str(out),
    )
    trainer.fit(ImageClassifier(model), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the test dumps the stacks of a rank that hangs
    main(sys.argv[1], Path(sys.argv[2]))

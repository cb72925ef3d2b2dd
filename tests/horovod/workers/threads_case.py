"""One short ``Trainer(strategy="horovod")`` fit; prints the torch threads each rank trained with.

Launched by test_horovod_threads.py under horovodrun WITHOUT OMP_NUM_THREADS (the other Horovod workers force
one thread, which hid that the strategy left every rank at torch's default of all cores).
"""

import os

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _num_cpus_available
from lightning.pytorch.callbacks import Callback

from lightning_hpc import ImageClassifier


class Report(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            print(f"THREADS rank={trainer.global_rank} threads={torch.get_num_threads()} cpus={_num_cpus_available()} "
                  f"local={int(os.environ['HOROVOD_LOCAL_SIZE'])}", flush=True)


ds = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
model = ImageClassifier(
    torch.nn.Sequential(torch.nn.Linear(4, 2)), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_classes=2
)
trainer = pl.Trainer(strategy="horovod", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Report()])
trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=2))

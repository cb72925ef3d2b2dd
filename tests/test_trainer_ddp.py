"""Trainer-level harness check: ImageClassifier under DDP with 2 CPU processes equals one process on the global
batch."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hpc import ImageClassifier
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from tests.fit_harness import fit


class _DestroyGroupAtExit(pl.Callback):
    """Stock DDP leaves gloo's group alive; a spawned rank can then abort at interpreter exit after a finished
    fit (pytorch#190489). Registered in every rank, as our own strategies do."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        destroy_process_group_at_exit()


class _Data(pl.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.ds = TensorDataset(torch.randn(48, 3, 4, 4, generator=g), torch.randint(0, 5, (48,), generator=g))

    def train_dataloader(self):
        # Lightning's own distributed sampler shuffles training data; an explicit unshuffled one makes the
        # per-rank batches predictable so the run can be compared with one process.
        sampler = DistributedSampler(self.ds, shuffle=False) if self.trainer.world_size > 1 else None
        return DataLoader(self.ds, batch_size=self.batch_size, sampler=sampler)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=1e-3)


#: one epoch of 4 steps on the datamodule's own (unshuffled) sampler
RUN = dict(max_epochs=1, limit_train_batches=4, use_distributed_sampler=False)


def test_two_process_ddp_equals_single_process_on_global_batch():
    ddp = ImageClassifier(_model(), optimizer=_sgd, num_classes=5)
    fit(ddp, datamodule=_Data(4), devices=2, strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo"),
        callbacks=[_DestroyGroupAtExit()], **RUN)
    # DistributedSampler(shuffle=False) gives rank r the samples r, r+2, ...: step k of the two ranks together
    # covers samples 8k..8k+7, exactly the k-th batch of 8 of one process.
    serial = ImageClassifier(_model(), optimizer=_sgd, num_classes=5)
    fit(serial, datamodule=_Data(8), devices=1, strategy="auto", callbacks=[_DestroyGroupAtExit()], **RUN)
    for p, q in zip(ddp.model.parameters(), serial.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(serial.model[1].weight, _model()[1].weight)  # training actually moved the weights

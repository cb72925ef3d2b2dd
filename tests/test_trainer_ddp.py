"""Trainer-level harness check: ImageClassifier under DDP with 2 CPU processes equals one process on the global
batch."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hpc import ImageClassifier
from lightning_hpc.distributed.exit import destroy_process_group_at_exit


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


def _fit(strategy, devices: int, batch_size: int) -> ImageClassifier:
    module = ImageClassifier(_model(), optimizer=_sgd, num_classes=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_DestroyGroupAtExit()],
    )
    trainer.fit(module, datamodule=_Data(batch_size))
    return module


def test_two_process_ddp_equals_single_process_on_global_batch():
    ddp = _fit(DDPStrategy(start_method="spawn", process_group_backend="gloo"), devices=2, batch_size=4)
    # DistributedSampler(shuffle=False) gives rank r the samples r, r+2, ...: step k of the two ranks together
    # covers samples 8k..8k+7, exactly the k-th batch of 8 of one process.
    serial = _fit("auto", devices=1, batch_size=8)
    for p, q in zip(ddp.model.parameters(), serial.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(serial.model[1].weight, _model()[1].weight)  # training actually moved the weights

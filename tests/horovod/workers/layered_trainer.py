"""Trainer(strategy=LayeredSGDStrategy(procs_per_node=2)) launched by ``horovodrun -np 4 --gloo``.

The strategy takes its ranks from Horovod and, with ``communicator="auto"``, runs its intra-group and
inter-group steps on Horovod process sets.  Every rank writes OUT/rank{r}.pt: final parameters and which
communicator and group types it used.  The test compares with synchronous SGD in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

WORLD, PER_NODE, LOCAL_BATCH, BATCHES = 4, 2, 4, 4
N = WORLD * LOCAL_BATCH * BATCHES
LR, MOMENTUM, WD = 0.3, 0.9, 1e-2


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (N,), generator=g))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def optim(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def main(out: Path) -> None:
    # here, not at import: the tests import this module for its constants and must keep their own threads
    torch.set_num_threads(1)
    import lightning.pytorch as pl

    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt, sched = optim(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=LOCAL_BATCH, shuffle=False)

    module = Module()
    strategy = LayeredSGDStrategy(procs_per_node=PER_NODE, layered_timeout_s=120)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "params": [p.detach().clone() for p in module.net.parameters()],
            "comm": type(strategy.comm).__name__,
            "intra_group": type(strategy.groups.intra).__name__,
            "global_step": trainer.global_step,
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main(Path(sys.argv[1]))

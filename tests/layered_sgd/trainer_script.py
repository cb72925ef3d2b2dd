"""One rank of the Trainer-level layered SGD test (``main`` on 4 ranks forked by test_layered_strategy.py; as a script,
started 4 times with torchrun's variables).

Runs several ``Trainer.fit`` calls in the same process group (to pay the slow process start-up once) and, on
rank 0, saves what each run saw: final parameters, the gradients seen by ``on_before_optimizer_step``, the
parameters seen by validation, and the mid-epoch checkpoints.  The comparisons live in test_layered_strategy.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

WORLD, LOCAL_BATCH, BATCHES = 4, 4, 8
N = WORLD * LOCAL_BATCH * BATCHES
LR, MOMENTUM, WD, CLIP = 0.3, 0.9, 1e-2, 0.5


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def main(out: Path) -> None:
    # here, not at import: test_layered_strategy.py imports this module, and the test process keeps its threads
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    import lightning_hpc  # noqa: F401 - registers "layered_sgd"
    from lightning_hpc import KFAC
    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.val_seen: list[tuple[int, torch.Tensor]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.val_seen.append((self.trainer.global_step, flat(self.parameters())))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=LOCAL_BATCH, shuffle=False)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=LOCAL_BATCH, shuffle=False)

    class GradRecorder(Callback):
        """A gradient reader (like the K-FAC callback): must see the globally averaged gradients.  It only reads, so
        it declares itself safe to run when the postponed update is applied (the runs keep the postponed update)."""

        postponed_update_safe = True

        def __init__(self) -> None:
            self.seen: list[tuple[int, float, torch.Tensor]] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lr = optimizer.param_groups[0]["lr"]
            self.seen.append((trainer.global_step, lr, flat(p.grad for p in pl_module.parameters())))

    def fit(name: str, strategy, resume: str | None = None, kfac: bool = False, **trainer_kwargs):
        module, grads, after = Module(), GradRecorder(), GradRecorder()
        # K-FAC runs between the two recorders: `grads` sees the averaged gradient, `after` the preconditioned one.
        extra = (
            [
                KFAC(
                    factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=None, decomposition_dtype="float64"
                ),
                after,
            ]
            if kfac
            else []
        )
        ckpt = ModelCheckpoint(dirpath=out / f"{name}_ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            precision="64-true",
            callbacks=[grads, ckpt, *extra],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_train_batches=BATCHES,
            default_root_dir=str(out),
            **{"limit_val_batches": 1, **trainer_kwargs},
        )
        trainer.fit(module, ckpt_path=resume)
        if trainer.global_rank == 0:
            torch.save(
                {
                    "final": flat(module.parameters()),
                    "grads": grads.seen,
                    "val": module.val_seen,
                    "after_kfac": after.seen,
                },
                out / f"{name}.pt",
            )

    common = dict(max_steps=6, gradient_clip_val=CLIP, val_check_interval=2)
    fit("layered", LayeredSGDStrategy(procs_per_node=2), **common)
    fit("ddp", "ddp", **common)
    fit("layered_accum", LayeredSGDStrategy(procs_per_node=2), max_steps=3, accumulate_grad_batches=2,
        gradient_clip_val=CLIP, limit_val_batches=0)
    fit("layered_resumed", LayeredSGDStrategy(procs_per_node=2),
        resume=str(out / "layered_ckpt" / "epoch=0-step=3.ckpt"), **common)
    fit("ddp_resumed", "ddp", resume=str(out / "ddp_ckpt" / "epoch=0-step=3.ckpt"), **common)
    kfac_common = dict(max_steps=4, limit_val_batches=0, kfac=True)
    fit("layered_kfac", LayeredSGDStrategy(procs_per_node=2), **kfac_common)
    fit("ddp_kfac", "ddp", **kfac_common)


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main(Path(sys.argv[1]))
    os._exit(0)  # skip slow interpreter teardown of the gloo groups

"""One rank of the Trainer-level tests of layered SGD's step observers (``main`` on 2 ranks forked by
test_observer_runs.py).

Each fit records, on rank 0, what user code saw: the weights a ``ModelCheckpoint`` subclass reads in its own
``on_train_batch_end``, the gradients ``on_after_backward`` (module hook and a callback) reads, the final
weights, and the warnings the run raised.  The comparisons (with one process and with DDP) live in
test_observer_runs.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from trainer_script import flat, net  # the same two-layer float64 net as the 4-rank tests

__all__ = ["dataset", "flat", "main", "net"]

WORLD, LOCAL_BATCH, STEPS = 2, 4, 4
LR, MOMENTUM, WD = 0.3, 0.9, 1e-2


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = WORLD * LOCAL_BATCH * 2 * STEPS
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64),
                                          torch.randint(0, 3, (n,), generator=g))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    import lightning_hpc  # noqa: F401 - registers "layered_sgd"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(dataset(), batch_size=LOCAL_BATCH, shuffle=False)

    class GradsAfterBackward(Module):
        """Reads the gradient in its own ``on_after_backward`` (a logged gradient norm, a gradient check)."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[torch.Tensor] = []

        def on_after_backward(self) -> None:
            self.seen.append(flat(p.grad for p in self.parameters()))

    class CallbackGradsAfterBackward(Callback):
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def on_after_backward(self, trainer, pl_module) -> None:
            self.seen.append(flat(p.grad for p in pl_module.parameters()))

    class SavesWeightsAtBatchEnd(ModelCheckpoint):
        """A checkpoint subclass with an ``on_train_batch_end`` of its own: what it reads there must be the weights
        after this batch's update, as on one process."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.seen: list[tuple[int, torch.Tensor]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.append((trainer.global_step, flat(pl_module.parameters())))
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def fit(name: str, strategy, module: pl.LightningModule, callbacks: list, **kwargs) -> None:
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", callbacks=list(callbacks),
            logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=STEPS,
            default_root_dir=str(out / name), **kwargs,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module)
        if trainer.global_rank == 0:
            record = {"final": flat(module.parameters()), "warnings": [str(w.message) for w in caught]}
            record |= {f"cb{i}": cb.seen for i, cb in enumerate(callbacks)}
            record["module"] = getattr(module, "seen", None)
            torch.save(record, out / f"{name}.pt")

    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy

    fit("checkpoint_subclass", LayeredSGDStrategy(procs_per_node=1), Module(),
        [SavesWeightsAtBatchEnd(dirpath=out / "ckpt", every_n_train_steps=STEPS)])
    for strategy in ("layered_sgd", "ddp"):
        fit(f"after_backward_{strategy}", strategy, GradsAfterBackward(), [CallbackGradsAfterBackward()])
        fit(f"after_backward_accumulate_{strategy}", strategy, GradsAfterBackward(), [CallbackGradsAfterBackward()],
            accumulate_grad_batches=2)

"""A copy of the model kept in the LightningModule (timm's ``ModelEmaV2`` pattern: ``copy.deepcopy`` in
``__init__``, updated element-wise from ``model.state_dict()`` after each batch, evaluated in validation) is split
alike under ``strategy='multigrid'``: its update pairs the same steps and the EMA equals one process's, in the
partitioned model and in a multigrid solve with enough cycles to be exact; after fit the copy is whole again.  So
is the copy Lightning's ``EMAWeightAveraging`` callback keeps (its ``StochasticWeightAveraging``: the conformance
matrix's ``swa`` row)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import fit
from model_ema import ModelEma
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import MultigridStrategy
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models import ode_resnet

STEPS = 3


class TrainsWithEma(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ode_resnet(in_channels=2, num_steps=8, width=4)
        self.ema = ModelEma(self.model, decay=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update(self.model)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ema_loss", F.cross_entropy(self.ema.module(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 4, 2, 8, 8, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (STEPS * 4,), generator=g)), batch_size=4)


def _train(rank: int, world: int, mode: str | None) -> dict:
    # the ranks of a layer chain see the same batches: one process on them is the reference
    strategy = MultigridStrategy(mode=mode, cfactor=2, forward_cycles=4, backward_cycles=4) if mode else "auto"
    run = fit(TrainsWithEma(), _loader(), devices=world, strategy=strategy, precision="64-true",
              max_steps=STEPS, use_distributed_sampler=False)
    module = run.module
    assert module is not None
    trainer = run.trainer
    metrics = trainer.validate(module, _loader(), verbose=False)[0] if trainer is not None else {}
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "val": metrics}


@pytest.mark.parametrize("mode", ["pm", "mg"])
def test_an_ema_copy_of_the_model_is_split_alike_and_equals_one_process(mode):
    """``mg`` with N/c = 4 cycles, where two-level MGRIT with F-relaxation is exact."""
    results = run_in_processes(_train, 2, mode, timeout_s=240)
    one = _train(0, 1, None)
    assert any(k.startswith("ema.module.steps.7") for k in one["state"])
    for rank, res in enumerate(results):
        assert list(res["state"]) == list(one["state"]), rank  # whole again: every step of model and copy
        for key, value in one["state"].items():
            torch.testing.assert_close(res["state"][key], value, rtol=0, atol=1e-9, msg=f"rank {rank}: {key}")
        assert res["val"]["val_ema_loss"] == pytest.approx(one["val"]["val_ema_loss"], rel=1e-9)
    # the control: the EMA moved away from the model and from its start (the update acted)
    ema = one["state"]["ema.module.steps.7.branch.0.weight"]
    assert not torch.allclose(ema, one["state"]["model.steps.7.branch.0.weight"])


class TrainsPlain(TrainsWithEma):
    """The same module without its own EMA: Lightning's EMAWeightAveraging callback keeps one."""

    def __init__(self) -> None:
        super().__init__()
        del self.ema

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


def _averaging(kind: str) -> pl.Callback:
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

    # SWA averages from the second of the two epochs (swa_epoch_start counts from 1)
    if kind == "swa":
        return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    return EMAWeightAveraging(decay=0.5)


def _train_with_averaging_callback(rank: int, world: int, kind: str, directory: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = MultigridStrategy(mode="pm", cfactor=2) if world > 1 else "auto"
    # a checkpoint after each epoch, while the trunk (and the callback's copy) are split
    checkpoints = ModelCheckpoint(dirpath=os.path.join(directory, str(world)), save_top_k=-1, filename="{epoch}")
    run = fit(TrainsPlain(), _loader(), devices=world, strategy=strategy, precision="64-true", max_epochs=2,
              use_distributed_sampler=False, callbacks=[_averaging(kind), checkpoints], limit_val_batches=0,
              enable_checkpointing=True)
    assert run.module is not None
    # at the end of fit the callback copies the average into the module
    return {"state": {k: v.detach().clone() for k, v in run.module.state_dict().items()}}


def _averaged_in_checkpoint(directory: str, world: int, epoch: int, kind: str) -> dict[str, torch.Tensor]:
    """The averaged model a checkpoint holds: SWA's in its callback state, the EMA's in place of the model's."""
    ckpt = torch.load(os.path.join(directory, str(world), f"epoch={epoch}.ckpt"), map_location="cpu",
                      weights_only=False)
    if kind == "swa":
        (state,) = [s for k, s in ckpt["callbacks"].items() if k.startswith("StochasticWeightAveraging")]
        return state["average_model_state"]
    TrainsPlain().load_state_dict(ckpt["current_model_state"])  # the model's own state: whole as well
    return ckpt["state_dict"]


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_lightnings_averaging_callbacks_average_a_copy_split_alike_and_checkpoint_it_whole(kind, tmp_path):
    """EMAWeightAveraging / StochasticWeightAveraging under the partitioned trunk: the module after fit (the average
    copied in) and the averaged copy each epoch's checkpoint holds (every step: it loads strictly into the user's
    class) equal one process's."""
    results = run_in_processes(_train_with_averaging_callback, 2, kind, str(tmp_path), timeout_s=240)
    one = _train_with_averaging_callback(0, 1, kind, str(tmp_path))
    for rank, res in enumerate(results):
        assert list(res["state"]) == list(one["state"]), rank
        for key, value in one["state"].items():
            torch.testing.assert_close(res["state"][key], value, rtol=0, atol=1e-9, msg=f"rank {rank}: {key}")
    for epoch in range(2):
        got = _averaged_in_checkpoint(str(tmp_path), 2, epoch, kind)
        TrainsPlain().load_state_dict(got)  # strict: every step, under the user's names
        for key, value in _averaged_in_checkpoint(str(tmp_path), 1, epoch, kind).items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-9, msg=f"epoch {epoch}: {key}")

"""Lightning's weight-averaging callbacks under ``strategy='hybrid_fc'``: ``StochasticWeightAveraging`` and
``EMAWeightAveraging`` keep a copy of the LightningModule (made in their ``setup``, before the strategy splits the
head), which the strategy splits alike, so averaging, swapping it in for validation and copying it into the module
at the end pair the same blocks of the same head layers; checkpoints hold it whole, and after fit it is handed back
whole with the model.  Each run is compared with one process on the global batches (float64, 1e-9), with and
without K-FAC."""

from __future__ import annotations

import os
import re

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import fit, trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from test_hybrid_twins import _data, _loaders, _net

from lightning_hpc import KFAC, HybridParallelStrategy
from lightning_hpc._compat import averaged_copy
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import full_state_dict

K, EPOCHS = 2, 3


class Plain(pl.LightningModule):
    """A user's classifier: conv trunk, two-layer fully-connected head, validation loss logged."""

    def __init__(self, val: object = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _net()
        self.val = val

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return self.val

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _callback(kind: str) -> pl.Callback:
    if kind == "swa":
        # averaging from the second epoch of three (swa_epoch_start counts from 1): the first epoch's checkpoint
        # holds the copy as the callback made it, the next two average, and the average is copied into the model
        return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    return EMAWeightAveraging(decay=0.5)


def _train(rank: int, world: int, kind: str, kfac: bool, directory: str) -> dict:
    train, val = _loaders(rank, world)
    averaging = _callback(kind)
    callbacks: list[pl.Callback] = [averaging]
    if kfac:
        callbacks.append(KFAC(factor_update_freq=1, inv_update_freq=1, factor_dtype="float64",
                              decomposition_dtype="float64"))
    # a checkpoint after every epoch, while the head (and the averaged copy) are split
    callbacks.append(ModelCheckpoint(dirpath=os.path.join(directory, str(world)), save_top_k=-1,
                                     filename="{epoch}"))
    strategy = HybridParallelStrategy() if world > 1 else "auto"
    module = Plain(val)
    run = fit(module, train, devices=world, strategy=strategy, precision="64-true", callbacks=callbacks,
              max_epochs=EPOCHS, use_distributed_sampler=False, enable_checkpointing=True)
    fresh = Plain()
    fresh.load_state_dict(module.state_dict())  # strict: the user's structure, whole tensors
    average = averaged_copy(averaging)
    assert average is not None
    with torch.no_grad():
        logits = module(_data(4, 9)[0])  # on this rank alone
    averaged = {k: v.clone() for k, v in average.state_dict().items()}
    # a later stage splits the model and the copy again (the EMA swaps its copy in around validation)
    assert run.trainer is not None
    validated = run.trainer.validate(module, val, verbose=False)[0]["val_loss"]
    return {"params": run.params, "val": run.metric("val_loss"), "average": averaged, "logits": logits,
            "validated": validated, "after_validate": [p.detach().clone() for p in module.parameters()]}


def _checkpoint(directory: str, world: int, epoch: int, prefix: str = "") -> dict:
    return torch.load(os.path.join(directory, f"{prefix}{world}", f"epoch={epoch}.ckpt"), map_location="cpu",
                      weights_only=False)


def _averaged_state(checkpoint: dict, kind: str) -> dict[str, torch.Tensor]:
    """The averaged model a checkpoint holds: SWA's in its callback state, the EMA's in place of the model's."""
    if kind == "swa":
        (state,) = [s for k, s in checkpoint["callbacks"].items() if k.startswith("StochasticWeightAveraging")]
        return state["average_model_state"]
    return checkpoint["state_dict"]


@pytest.mark.parametrize("kind, kfac", [("swa", False), ("ema", False), ("swa", True), ("ema", True)],
                         ids=["swa", "ema", "swa_kfac", "ema_kfac"])
def test_weight_averaging_trains_validates_and_checkpoints_as_one_process(kind, kfac, tmp_path):
    """The final parameters (SWA: the average copied into the model at the end; EMA: the same), the averaged copy,
    the validation loss (the EMA's weights swapped in), the forward on one rank alone after fit, and every epoch's
    checkpoint (the averaged model whole: it loads strictly into the user's class) equal one process's."""
    results = run_in_processes(_train, K, kind, kfac, str(tmp_path), timeout_s=400)
    one = _train(0, 1, kind, kfac, str(tmp_path))
    for rank, res in enumerate(results):
        assert len(res["params"]) == len(one["params"]) == 6, rank
        for got, want in zip(res["params"], one["params"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        assert list(res["average"]) == list(one["average"]), rank  # handed back whole
        for key, want in one["average"].items():
            torch.testing.assert_close(res["average"][key], want, rtol=0, atol=1e-9, msg=f"rank {rank}: {key}")
        torch.testing.assert_close(res["val"], one["val"], rtol=0, atol=1e-9)
        torch.testing.assert_close(res["logits"], one["logits"], rtol=0, atol=1e-9)
        assert res["validated"] == pytest.approx(one["validated"], rel=1e-9, abs=0), rank
        torch.testing.assert_close(res["after_validate"], one["after_validate"], rtol=0, atol=1e-9)
    for epoch in range(EPOCHS):
        got, want = _checkpoint(str(tmp_path), K, epoch), _checkpoint(str(tmp_path), 1, epoch)
        averaged = _averaged_state(got, kind)
        Plain().load_state_dict(averaged)  # strict: whole tensors under the user's names
        for key, value in _averaged_state(want, kind).items():
            torch.testing.assert_close(averaged[key], value, rtol=0, atol=1e-9, msg=f"epoch {epoch}: {key}")
        Plain().load_state_dict(got.get("current_model_state", got["state_dict"]))
    # the control: the average differs from the last weights trained (it acted), SWA's from its first epoch on
    last = _checkpoint(str(tmp_path), 1, EPOCHS - 1)
    trained = last.get("current_model_state", last["state_dict"])
    # (Lightning's SWA keeps its copy in the dtype the module had when the callback copied it: float32 here)
    averaged = _averaged_state(last, kind)["model.6.weight"]
    assert not torch.allclose(averaged.double(), trained["model.6.weight"], rtol=0, atol=1e-3)


class GrowsInSetup(Plain):
    """A module that adds a parameter in ``setup``, after the callback's ``setup`` copied it."""

    def setup(self, stage: str) -> None:
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.scale


def _refused(rank: int, world: int, case: str) -> tuple[int, str | None]:
    train, _ = _loaders(rank, world)
    if case == "device":  # the average kept on a device this process cannot use (CUDA in a CPU-only build)
        module, averaging = Plain(), StochasticWeightAveraging(swa_lrs=0.05, device="cuda")
    else:
        module, averaging = GrowsInSetup(), EMAWeightAveraging(decay=0.5)
    run = fit(module, train, devices=world, strategy=HybridParallelStrategy(), precision="64-true",
              callbacks=[averaging], max_epochs=1, use_distributed_sampler=False, refusal_is_result=True)
    return run.steps, run.error


@pytest.mark.parametrize("case, message", [
    ("device", r"StochasticWeightAveraging keeps its averaged copy of the LightningModule on cuda, which this "
               r"process cannot use.*StochasticWeightAveraging\(\.\.\., device=None\)"),
    ("grows_in_setup", r"the copy of the LightningModule EMAWeightAveraging made in its setup does not hold the "
                       r"module's parameters.*Build the layers in __init__"),
])
def test_an_average_that_cannot_be_split_alike_is_refused_before_the_first_step(case, message):
    if case == "device" and torch.cuda.is_available():
        pytest.skip("the case needs a device this process cannot use: CUDA is usable here")
    for steps, error in run_in_processes(_refused, K, case, timeout_s=240):
        assert steps == 0 and error is not None
        assert re.search(message, error), error


class _Starts(pl.Callback):
    """Records the module's whole state as training starts and the validation loss of the sanity check."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = full_state_dict(pl_module) if trainer.world_size > 1 else dict(pl_module.state_dict())
        self.state = {k: v.detach().clone() for k, v in self.state.items()}

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sanity_val = trainer.callback_metrics["val_loss"].clone()


def _train_built_on_meta(rank: int, world: int, kind: str, directory: str, start: dict | None = None,
                         empty_init: bool | None = None) -> dict:
    """``Trainer.init_module()``: under hybrid_fc the head's layers are built on the meta device (each rank then
    allocates its shards), so the callback copies a module without head values; one process (``start``: the
    2-rank run's initial weights) builds it whole."""
    train, val = _loaders(rank, world)
    averaging, starts = _callback(kind), _Starts()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(directory, f"meta{world}"), save_top_k=-1,
                                  filename="{epoch}")
    run = trainer(devices=world, strategy=HybridParallelStrategy() if world > 1 else "auto", precision="64-true",
                  callbacks=[averaging, starts, checkpoints], max_epochs=EPOCHS, use_distributed_sampler=False,
                  enable_checkpointing=True)
    with run.init_module(empty_init=empty_init):
        module = Plain(val)
    if start is not None:
        module.load_state_dict(start)
    try:
        run.fit(module, train)
    except ValueError as e:  # the refusal, before any step
        return {"error": str(e), "steps": run.global_step}
    average = averaged_copy(averaging)
    assert average is not None
    return {"start": starts.state, "sanity_val": starts.sanity_val, "val": run.callback_metrics["val_loss"],
            "params": [p.detach().clone() for p in module.parameters()],
            "average": {k: v.clone() for k, v in average.state_dict().items()}}


@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_an_average_copied_from_a_head_on_the_meta_device_starts_as_the_model(kind, tmp_path):
    """SWA: the copy gets the model's initial weights (the first checkpoint's average, before any update) and
    training ends as on one process from the same start.  EMA: Lightning's callback moves its copy to the device in
    its setup, which a module on the meta device cannot: refused before the first step naming the fix
    (``Trainer.init_module(empty_init=False)``), and with the fix it trains as one process (the EMA swapped in for
    the sanity check's validation included)."""
    empty_init = None
    if kind == "ema":
        for res in run_in_processes(_train_built_on_meta, K, kind, str(tmp_path), timeout_s=400):
            assert res["steps"] == 0 and re.search(r"EMAWeightAveraging copies the LightningModule.*meta device.*"
                                                   r"Trainer.init_module\(empty_init=False\)", res["error"])
        empty_init = False
    results = run_in_processes(_train_built_on_meta, K, kind, str(tmp_path), None, empty_init, timeout_s=400)
    one = _train_built_on_meta(0, 1, kind, str(tmp_path), results[0]["start"])
    torch.testing.assert_close(one["start"], results[0]["start"], rtol=0, atol=0)
    for rank, res in enumerate(results):
        for what in ("sanity_val", "val", "params", "average"):
            torch.testing.assert_close(res[what], one[what], rtol=0, atol=1e-9, msg=f"rank {rank}: {what}")
    got, want = _checkpoint(str(tmp_path), K, 0, "meta"), _checkpoint(str(tmp_path), 1, 0, "meta")
    for key, value in _averaged_state(want, kind).items():  # SWA: the copy as it started
        torch.testing.assert_close(_averaged_state(got, kind)[key], value, rtol=0, atol=1e-9, msg=key)

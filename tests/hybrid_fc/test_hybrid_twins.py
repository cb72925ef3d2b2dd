"""A frozen copy of the model kept beside it (timm's ``ModelEmaV2``: ``copy.deepcopy`` in ``__init__``, updated
element-wise over ``zip(state_dict().values())`` after every step, evaluated in validation) is split as the model
is, so the update pairs the same blocks and the copy trains, validates and is handed back as on one process."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import fit
from model_ema import ModelEma
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC, HybridParallelStrategy
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import find_head, linear_layers_on_meta
from lightning_hpc.hybrid_fc.twins import find_twins, trained_original

B, STEPS, K, VAL = 4, 3, 2, 8


def _net(weight_norm: bool = False) -> nn.Sequential:
    """``weight_norm``: the head's layers weight-normalised (their shards hold g and v, not a weight)."""
    wrap = torch.nn.utils.parametrizations.weight_norm if weight_norm else (lambda m: m)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
                         wrap(nn.Linear(64, 24)), nn.ReLU(), wrap(nn.Linear(24, 10)))


class EmaUser(pl.LightningModule):
    def __init__(self, val: DataLoader | None = None, optimize_all: bool = False, weight_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.val, self.optimize_all = val, optimize_all
        self.model = _net(weight_norm)
        self.ema = ModelEma(self.model)
        self.checkpointed: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, *args) -> None:
        self.ema.update(self.model)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_ema_loss", F.cross_entropy(self.ema.module(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader | None:
        return self.val

    def on_train_end(self) -> None:
        # what a checkpoint saved now holds (rank 0's copy is the full one)
        self.checkpointed = self.trainer.strategy.lightning_module_state_dict()

    def configure_optimizers(self):
        # optimize_all: the optimizer holds the EMA's frozen parameters too (they get no gradient, so no step)
        return torch.optim.SGD((self if self.optimize_all else self.model).parameters(), lr=0.1, momentum=0.9)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


def _loaders(rank: int, world: int) -> tuple[DataLoader, DataLoader]:
    x, y = _data(STEPS * K * B, 7)
    xv, yv = _data(K * VAL, 8)
    # rank r's batches are the r-th part of each global batch: one process on the global batches is the reference
    mine = torch.cat([torch.arange(s * K * B + rank * B * K // world, s * K * B + (rank + 1) * B * K // world)
                      for s in range(STEPS)])
    val = torch.arange(rank * VAL * K // world, (rank + 1) * VAL * K // world)
    return (DataLoader(TensorDataset(x[mine], y[mine]), batch_size=B * K // world),
            DataLoader(TensorDataset(xv[val], yv[val]), batch_size=VAL * K // world))


def _train(rank: int, world: int, kfac: bool = False, optimize_all: bool = False, weight_norm: bool = False) -> dict:
    train, val = _loaders(rank, world)
    strategy = HybridParallelStrategy() if world > 1 else "auto"
    module = EmaUser(val, optimize_all, weight_norm)
    callbacks = ([KFAC(factor_update_freq=1, inv_update_freq=1, factor_dtype="float64", decomposition_dtype="float64")]
                 if kfac else [])
    run = fit(module, train, devices=world, strategy=strategy, precision="64-true", callbacks=callbacks,
              max_steps=STEPS, use_distributed_sampler=False, num_sanity_val_steps=0)
    fresh = EmaUser(weight_norm=weight_norm)
    fresh.load_state_dict(module.state_dict())  # strict: the user's structure, whole tensors
    with torch.no_grad():
        logits = module.ema.module(_data(4, 9)[0])  # on this rank alone
    optimized = [tuple(p.shape) for g in run.trainer.optimizers[0].param_groups for p in g["params"]]
    return {"params": run.params, "optimized": optimized, "val": run.metric("val_ema_loss"),
            "ema_type": type(module.ema.module).__name__,
            "ema_state": {k: v.clone() for k, v in module.ema.state_dict().items()}, "logits": logits,
            "checkpointed": {k: v.clone() for k, v in module.checkpointed.items()}}


@pytest.mark.parametrize("kfac, optimize_all, weight_norm",
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
                         ids=["sgd", "kfac", "optimizer_holds_the_ema", "weight_norm_head"])
def test_an_ema_copy_trains_validates_and_is_handed_back_as_on_one_process(kfac, optimize_all, weight_norm):
    """``kfac``: K-FAC preconditions the model's layers and leaves the EMA's (frozen) alone, as on one process;
    ``optimize_all``: the optimizer holds the EMA's shards while split and its whole parameters after fit;
    ``weight_norm``: the head's layers are weight-normalised, so the copy's shards are its frozen g and v."""
    results = run_in_processes(_train, K, kfac, optimize_all, weight_norm, timeout_s=240)
    one = _train(0, 1, kfac, optimize_all, weight_norm)
    # the model's tensors and the EMA's: 6 each, 8 each with g and v in place of two weights
    assert len(one["params"]) == (16 if weight_norm else 12)
    for rank, res in enumerate(results):
        assert res["ema_type"] == "Sequential", rank
        assert res["optimized"] == one["optimized"], rank  # rebound to the whole parameters
        assert len(res["params"]) == len(one["params"])
        for got, want in zip(res["params"], one["params"]):  # the model's and the EMA's weights, whole
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        for key, want in one["ema_state"].items():
            torch.testing.assert_close(res["ema_state"][key], want, rtol=0, atol=1e-9)
        torch.testing.assert_close(res["val"], one["val"], rtol=0, atol=1e-9)  # the EMA evaluated in validation
        torch.testing.assert_close(res["logits"], one["logits"], rtol=0, atol=1e-9)
    # a checkpoint taken while split holds the EMA whole, with its trained values
    assert list(results[0]["checkpointed"]) == list(one["checkpointed"])
    for key, want in one["checkpointed"].items():
        torch.testing.assert_close(results[0]["checkpointed"][key], want, rtol=0, atol=1e-9)


# -- which copies are twins (on the unsplit model, one process) ------------------------------------------------
class _Holds(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def _frozen(m: nn.Module) -> nn.Module:
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def test_a_frozen_copy_is_a_twin_wherever_it_is_registered():
    net = _net()
    for root in (_Holds(model=net, ema=_Holds(module=_frozen(copy.deepcopy(net)))),
                 _Holds(ema=_Holds(module=_frozen(copy.deepcopy(net))), model=net)):
        spec = trained_original(root, find_head(root))  # the last layers found are the copy's: the model's head
        assert spec.parent_name == "model" and spec.start == 4
        assert [(t.parent_name, t.start, [n for n, _ in t.modules]) for t in find_twins(root, spec)] == [
            ("ema.module", 4, ["4", "5", "6"])]


def test_a_copy_of_an_ancestor_is_a_twin_of_the_head_at_its_place():
    outer = _Holds(trunk=nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(1)), classifier=nn.Sequential(
        nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 3)))
    root = _Holds(net=outer, teacher=_frozen(copy.deepcopy(outer)))
    spec = trained_original(root, find_head(root))
    assert spec.parent_name == "net.classifier"
    assert [t.parent_name for t in find_twins(root, spec)] == ["teacher.classifier"]


def test_a_copy_that_trains_or_shares_the_models_tensors_is_no_twin():
    net = _net()
    ensemble = _Holds(model=net, other=copy.deepcopy(net))  # trains: a model of its own, whole in the trunk
    spec = trained_original(ensemble, find_head(ensemble))
    assert spec.parent_name == "other" and find_twins(ensemble, spec) == []
    frozen = _frozen(_net())
    alias = _Holds(model=frozen, view=nn.Sequential(*frozen))  # the same tensors under another name, not a copy
    assert find_twins(alias, find_head(alias)) == []


class _OwnLinear(nn.Linear):
    pass


def test_a_copy_with_other_layers_at_the_heads_place_is_refused_naming_it():
    net = _net()
    other = copy.deepcopy(net)
    other[6] = _OwnLinear(24, 10)
    root = _Holds(model=net, ema=_frozen(other))
    with pytest.raises(ValueError, match=r"'ema' has the parameters of the head's container 'model'.*copy\.deepcopy"):
        find_twins(root, trained_original(root, find_head(root)))


def test_a_copy_made_on_the_meta_device_is_refused_naming_the_fix():
    with linear_layers_on_meta():
        net = _net()
    root = _Holds(model=net, ema=_frozen(copy.deepcopy(net)))
    with pytest.raises(ValueError, match=r"'ema'.*meta device.*empty_init=False"):
        find_twins(root, trained_original(root, find_head(root)))

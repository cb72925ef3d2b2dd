"""A fully-connected head of ``weight_norm``'ed linear layers trains under ``hybrid_fc`` as on one process and
is handed back as the user's parametrized layers with whole ``g`` and ``v``; a head layer whose parametrization
cannot be split (``spectral_norm``, the deprecated hook-based ``weight_norm``) is refused before the first step
naming the layer and a fix, and the fix trains as one process does."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import fit
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import HybridParallelStrategy
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import HybridHead, find_hybrid_head, plan_layout

B, STEPS, K = 4, 3, 2
FIRST = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "legacy_weight_norm": torch.nn.utils.weight_norm,
}


def _data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = STEPS * k * B
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)


class WeightNormHead(pl.LightningModule):
    """A conv trunk and the head ``first(nn.Linear(64, 24)), ReLU, weight_norm(nn.Linear(24, 10))``."""

    def __init__(self, first: str = "weight_norm") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
            FIRST[first](nn.Linear(64, 24)), nn.ReLU(), parametrizations.weight_norm(nn.Linear(24, 10)),
        )
        self.layouts: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_train_start(self) -> None:
        if self.trainer.world_size > 1 and isinstance(self.trainer.strategy, HybridParallelStrategy):
            self.layouts = list(find_hybrid_head(self).layouts)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _train(rank: int, world: int, first: str, head: str | None = None) -> dict:
    x, y = _data(world)
    # rank r's batches are the r-th part of each global batch: one process on the global batches is the reference
    mine = torch.cat([torch.arange(s * world * B + rank * B, s * world * B + (rank + 1) * B) for s in range(STEPS)])
    loader = DataLoader(TensorDataset(x[mine], y[mine]), batch_size=B)
    strategy = HybridParallelStrategy(head=head) if world > 1 else "auto"
    run = fit(WeightNormHead(first), loader, devices=world, strategy=strategy, precision="64-true",
              max_steps=STEPS, limit_val_batches=0, use_distributed_sampler=False, refusal_is_result=True)
    module = run.module
    assert module is not None
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    head_types = [type(m).__name__ for m in module.model]
    with torch.no_grad():
        logits = module(x[:8])  # on this rank alone, after the handback
    return {"state": state, "error": run.error, "steps": run.steps, "layouts": module.layouts,
            "head_types": head_types, "logits": logits}


def _one_process(first: str) -> dict:
    x, y = _data(K)
    run = fit(WeightNormHead(first), DataLoader(TensorDataset(x, y), batch_size=K * B), precision="64-true",
              max_steps=STEPS, limit_val_batches=0)
    assert run.module is not None
    return {k: v.detach().clone() for k, v in run.module.state_dict().items()}


def _assert_as_one_process(results: list[dict], first: str) -> None:
    reference = _one_process(first)
    for rank, res in enumerate(results):
        assert res["error"] is None, res["error"]
        assert res["steps"] == STEPS
        assert list(res["state"]) == list(reference), rank  # the user's keys: g and v, not a sharded "weight"
        for key, want in reference.items():
            torch.testing.assert_close(res["state"][key], want, rtol=0, atol=1e-9, msg=f"rank {rank}: {key}")
        fresh = WeightNormHead(first).double()
        fresh.load_state_dict(res["state"], strict=True)  # the handed-back state is a fresh instance's
        with torch.no_grad():
            torch.testing.assert_close(res["logits"], fresh(_data(K)[0][:8]), rtol=0, atol=1e-9)


def test_weight_norm_head_trains_as_one_process_and_is_handed_back_whole():
    results = run_in_processes(_train, K, "weight_norm", timeout_s=240)
    _assert_as_one_process(results, "weight_norm")
    # the planner would split the last layer by input columns (row); weight-normalised layers are split by rows
    assert plan_layout([64, 24, 10], K) == ["col", "row"]
    for res in results:
        assert res["layouts"] == ["col", "col"], res["layouts"]
        assert res["head_types"][4:] == ["ParametrizedLinear", "ReLU", "ParametrizedLinear"], res["head_types"]


@pytest.mark.parametrize("first", ["spectral_norm", "legacy_weight_norm"])
def test_unsplittable_parametrization_is_refused_naming_the_layer_and_a_fix_that_works(first):
    refused = run_in_processes(_train, K, first, timeout_s=240)
    for res in refused:
        assert res["error"] is not None and res["steps"] == 0, res["error"]
        assert "cannot split the fully-connected head's layer 'model.4'" in res["error"], res["error"]
        assert "spectral_norm" in res["error"] if first == "spectral_norm" else "weight_norm" in res["error"]
        assert "HybridParallelStrategy(head='model.6')" in res["error"] and "strategy='ddp'" in res["error"]
    # the named fix: the refused layer trains whole in the data-parallel trunk, as on one process
    _assert_as_one_process(run_in_processes(_train, K, first, "model.6", timeout_s=240), first)


def test_forcing_a_row_layout_on_a_weight_norm_layer_is_refused():
    layers = [parametrizations.weight_norm(nn.Linear(8, 6)), parametrizations.weight_norm(nn.Linear(6, 4))]
    with pytest.raises(ValueError, match=r"head linear 1 is weight-normalised .* 'col' layout only"):
        HybridHead(layers, [[], []], [], {0: "0", 1: "1"}, layouts=["col", "row"])


def _kfac_run(rank: int, world: int) -> dict:
    from lightning_hpc import KFAC

    x, y = _data(K)
    if world > 1:
        mine = torch.cat([torch.arange(s * world * B + rank * B, s * world * B + (rank + 1) * B) for s in range(STEPS)])
        x, y = x[mine], y[mine]
    strategy = HybridParallelStrategy() if world > 1 else "auto"
    run = fit(WeightNormHead(), DataLoader(TensorDataset(x, y), batch_size=B if world > 1 else K * B),
              devices=world, strategy=strategy, precision="64-true", max_steps=STEPS, limit_val_batches=0,
              use_distributed_sampler=False, callbacks=[KFAC(factor_update_freq=1, inv_update_freq=1)],
              record_warnings=True)
    assert run.module is not None
    return {"state": {k: v.detach().clone() for k, v in run.module.state_dict().items()},
            "report": next((w for w in run.warnings if w.startswith("K-FAC preconditions")), None)}


def test_kfac_leaves_a_weight_norm_head_to_the_optimizer_as_on_one_process():
    """K-FAC cannot precondition a weight computed by a parametrization (its gradient goes to g and v); under
    hybrid_fc the shards are left out with that reason, as one process leaves the layers out, and the run is
    one process's.  (The report used to list the parametrized shards as preconditioned.)"""
    results = run_in_processes(_kfac_run, K, timeout_s=240)
    one = _kfac_run(0, 1)
    assert one["report"].startswith("K-FAC preconditions 1 layer(s)")
    preconditioned, _, left = results[0]["report"].partition("left to the optimizer")  # rank 0 reports
    assert "model.4" not in preconditioned and "model.6" not in preconditioned, results[0]["report"]
    assert "model.4 (ParametrizedShardedLinear): its weight is computed from other parameters" in left
    for res in results:
        for key, value in one["state"].items():
            torch.testing.assert_close(res["state"][key], value, rtol=0, atol=1e-9, msg=key)

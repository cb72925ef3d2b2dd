"""A model without a trunk of residual steps under ``strategy='multigrid'`` (no ``trunk`` set, no ``steps``
attribute: Lightning's demo modules, a plain classifier) has nothing to split over layer ranks: it trains data
parallel over every rank, as DDP does, and a warning says so; a ``trunk`` the user names must exist.  That such
runs equal one process on the global batch (DDP for the demo modules that make DDP differ) is owned by the
conformance matrix's multigrid columns."""

from __future__ import annotations

import pytest
import torch
from fit_harness import fit
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hpc import MultigridStrategy
from lightning_hpc.distributed import run_in_processes

NOTHING_SPLIT = "nothing is layer-parallel"


class RecordSampling(Callback):
    """What the strategy shards the training data over, seen from inside the run."""

    def on_train_start(self, trainer, pl_module):
        self.sampler = dict(trainer.strategy.distributed_sampler_kwargs)
        self.layer_parallel = trainer.strategy.layer_parallel_size


def _boring_under_multigrid(rank: int, world: int, mode: str) -> dict:
    torch.manual_seed(0)
    seen = RecordSampling()
    run = fit(BoringModel(), devices=world, strategy=MultigridStrategy(mode=mode), max_steps=2,
              limit_val_batches=0, callbacks=[seen], record_warnings=True)
    return {"sampler": seen.sampler, "layer_parallel": seen.layer_parallel,
            "warned": run.warned(NOTHING_SPLIT), "params": run.params}


@pytest.mark.parametrize("mode", ["mg", "pm"])
def test_a_model_without_a_trunk_trains_data_parallel_over_every_rank_with_a_warning(mode):
    results = run_in_processes(_boring_under_multigrid, 2, mode, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["layer_parallel"] == 1, res
        assert res["sampler"] == {"num_replicas": 2, "rank": rank}, res  # each rank its own samples
    assert results[0]["warned"] and "BoringModel" in results[0]["warned"][0], results[0]["warned"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # averaged gradients: the replicas stay equal


def test_mode_serial_without_a_trunk_says_nothing():
    run = fit(BoringModel(), strategy=MultigridStrategy(mode="serial"), max_steps=1, limit_val_batches=0,
              record_warnings=True)
    assert run.steps == 1 and not run.warned(NOTHING_SPLIT)


def test_a_named_trunk_that_is_missing_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"trunk='steps'.*BoringModel.*no attribute 'steps'.*leave trunk unset"):
        fit(BoringModel(), strategy=MultigridStrategy(trunk="steps"), max_steps=1, limit_val_batches=0)

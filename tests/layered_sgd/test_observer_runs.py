"""Step observers under layered SGD through ``Trainer.fit`` (2 CPU processes, float64, 1e-9): user code that
reads the weights or the gradients where the postponed update would show it something else sees what one process
(and DDP) shows.

- A ``ModelCheckpoint`` subclass that overrides ``on_train_batch_end`` runs user code there: it reads the weights
  after each step's update (the observer is found by the overridden hook, not by ``isinstance``).
- ``on_after_backward`` (the module's hook and a callback's) sees the gradient averaged over the ranks, as under
  DDP, including under ``accumulate_grad_batches`` (the rank's own accumulated gradient on the micro-batches that
  do not reduce, as under DDP's ``no_sync``); the run says so once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_hpc.distributed import run_in_processes

sys.path.insert(0, str(Path(__file__).parent))
import observer_script as osc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-9, atol=1e-9)
NAMES = ("checkpoint_subclass", "after_backward_layered_sgd", "after_backward_ddp",
         "after_backward_accumulate_layered_sgd", "after_backward_accumulate_ddp")


def _serial(steps: int):
    """One process on the global batch (the union of the ranks' batches; Lightning's DistributedSampler shuffles
    with seed 0): the weights after each step and each step's gradient."""
    model = osc.net()
    opt = torch.optim.SGD(model.parameters(), lr=osc.LR, momentum=osc.MOMENTUM, weight_decay=osc.WD)
    data = osc.dataset()
    x, y = data.tensors
    shards = [list(DistributedSampler(data, osc.WORLD, r, shuffle=True, seed=0)) for r in range(osc.WORLD)]
    weights, grads = [], []
    for b in range(steps):
        idx = [i for shard in shards for i in shard[b * osc.LOCAL_BATCH:(b + 1) * osc.LOCAL_BATCH]]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        grads.append(osc.flat(p.grad for p in model.parameters()))
        opt.step()
        weights.append(osc.flat(model.parameters()))
    return weights, grads


def _rank(rank: int, world: int, out: str) -> None:
    osc.main(Path(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("layered_observers")
    run_in_processes(_rank, osc.WORLD, str(out), timeout_s=600, collective_timeout_s=120,
                     env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in NAMES}


def test_checkpoint_subclass_reading_weights_at_batch_end_sees_this_steps_update(runs):
    weights, _ = _serial(osc.STEPS)
    run = runs["checkpoint_subclass"]
    seen = run["cb0"]
    assert [s for s, _ in seen] == list(range(1, osc.STEPS + 1))
    for (_, w), ref in zip(seen, weights):
        torch.testing.assert_close(w, ref, **TOL)
    torch.testing.assert_close(run["final"], weights[-1], **TOL)
    assert any("SavesWeightsAtBatchEnd.on_train_batch_end" in w for w in run["warnings"])


@pytest.mark.parametrize("who", ["module", "cb0"])
def test_on_after_backward_sees_the_averaged_gradient(runs, who):
    weights, grads = _serial(osc.STEPS)
    layered, ddp = runs["after_backward_layered_sgd"], runs["after_backward_ddp"]
    assert len(layered[who]) == len(ddp[who]) == osc.STEPS
    for g, g_ddp, ref in zip(layered[who], ddp[who], grads):
        torch.testing.assert_close(g_ddp, ref, **TOL)
        torch.testing.assert_close(g, ref, **TOL)
    torch.testing.assert_close(layered["final"], weights[-1], **TOL)
    torch.testing.assert_close(layered["final"], ddp["final"], **TOL)


def test_on_after_backward_under_accumulation_sees_what_ddp_shows(runs):
    """The first micro-batch of each step does not reduce (DDP's no_sync: the rank's own gradient), the last one
    does (the average of the accumulated gradients)."""
    layered, ddp = runs["after_backward_accumulate_layered_sgd"], runs["after_backward_accumulate_ddp"]
    for who in ("module", "cb0"):
        assert len(layered[who]) == len(ddp[who]) == 2 * osc.STEPS
        for g, g_ddp in zip(layered[who], ddp[who]):
            torch.testing.assert_close(g, g_ddp, **TOL)
    torch.testing.assert_close(layered["final"], ddp["final"], **TOL)


def test_the_run_says_once_that_on_after_backward_gets_the_reduction_first(runs):
    said = [w for w in runs["after_backward_layered_sgd"]["warnings"] if "on_after_backward" in w]
    assert len(said) == 1, said
    assert "GradsAfterBackward.on_after_backward, CallbackGradsAfterBackward.on_after_backward" in said[0]
    assert "average over the ranks" in said[0] and "updates the weights at once" in said[0]

"""hybrid_fc in float16 autocast with a ``GradScaler`` (what ``precision='16-mixed'`` gives on a GPU) skips exactly the
steps one process skips.

One process's autocast computes a linear layer's weight gradient as one float16 product, which overflows to
``inf`` where the scaled gradient passes 65504: the scaler then skips the step and halves its scale.  The sharded
head computes in float32 on float16-rounded operands, so its weight gradients must be rounded where one process's
are (``hybrid_fc/autocast_grads.py``), and a rank whose shard overflowed must make every rank skip
(``distributed/overflow.py``): before, the head's float32 gradients never overflowed (the scale grew to 16x one
process's), and with the rounding alone the ranks' verdicts went apart (rank 0, whose shard never overflows, took
every step and doubled its scale each time).  The network is built to overflow on some steps and not on others,
at a small initial scale that doubles after every good step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import HybridParallelStrategy
from lightning_hpc.distributed import run_in_processes
from tests.fit_harness import fit

STEPS, BATCH = 4, 8


class _OverflowingHead(pl.LightningModule):
    """Two linear layers, both sharded (the whole model is the head, the first layer split by its outputs); the last
    layer's weights from the first layer's outputs 8-15 large, so at some scales the first layer's weight gradient
    overflows in float16 in those rows only: in rank 1's shard, not in rank 0's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        with torch.no_grad():
            self.model[2].weight[:, 8:] *= 300.0
        self.scales: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _run(rank: int, world: int) -> tuple[list[torch.Tensor], list[float], float, str]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * BATCH, 8, generator=g) * 30, torch.randint(0, 4, (STEPS * BATCH,), generator=g)
    b = BATCH // world  # step s's global batch is samples [8 s, 8 s + 8) on one process and on two
    mine = torch.cat([torch.arange(BATCH * s + rank * b, BATCH * s + (rank + 1) * b) for s in range(STEPS)])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1)
    module = _OverflowingHead()
    run = fit(module, DataLoader(TensorDataset(x[mine], y[mine]), batch_size=b), devices=world,
              strategy=HybridParallelStrategy() if world > 1 else "auto",
              plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_steps=STEPS,
              use_distributed_sampler=False)
    assert run.error is None, run.error
    # the user's scaler is handed back with the state the run reached
    assert run.trainer.precision_plugin.scaler is scaler
    return [p.detach().double() for p in run.params], module.scales, float(scaler.get_scale()), type(
        module.model).__name__


def test_overflowing_steps_are_skipped_as_on_one_process():
    params, scales, final, _ = _run(0, 1)
    # the reference both skips and takes steps (a halved scale, a doubled one), so the test sees both
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:])), scales
    for rank, (got, got_scales, got_final, container) in enumerate(run_in_processes(_run, 2)):
        assert container == "Sequential"  # handed back whole
        assert got_scales == scales and got_final == final, (rank, got_scales, scales, got_final, final)
        for a, b in zip(got, params):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")

"""``check_parameter_use="every_step"`` (the default): a forward that starts using a parameter on a replicated value
after it met split activations (a data-dependent branch taken from the third step on) is refused at that step,
before its update, naming the parameter; ``"first_step"`` checks the first step only and lets that step's gradient
be summed over the tiles (measured: 4e-2 away from one process after 4 steps).  A forward whose branches never
change trains as on one process under both settings."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import Fit, fit

N, C, H, W = 8, 2, 9, 8


class Switching(pl.LightningModule):
    """``self.shift`` is added to the split feature map for two steps (a tile op uses the parameter itself: its
    gradient is a partial sum over tiles), then to the pooled (replicated) features."""

    def __init__(self, switch_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(C, 4, 3, padding=1)
        self.shift = nn.Parameter(torch.zeros(4, 1, 1))
        self.head = nn.Linear(4, 2)
        self.switch_at = switch_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = F.relu(self.conv(x))
        late = self.switch_at is not None and self.global_step >= self.switch_at
        if not late:
            h = h + self.shift
        pooled = h.mean((2, 3))
        if late:
            pooled = pooled + self.shift.flatten()
        return F.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _switching_run(rank=0, world=1, check="every_step", switch_at=2) -> Fit:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, C, H, W, generator=g), torch.randint(0, 2, (N,), generator=g))
    module = Switching(switch_at)
    strategy = SpatialParallelStrategy(spatial_parts=(2, 1), check_parameter_use=check) if world > 1 else "auto"
    return fit(module, DataLoader(data, batch_size=2), devices=world, strategy=strategy, max_steps=4,
               use_distributed_sampler=False, refusal_is_result=True)


def test_a_later_branch_that_mixes_uses_is_refused_before_its_update():
    for rank, res in enumerate(run_in_processes(_switching_run, 2, timeout_s=300, collective_timeout_s=60)):
        assert res.error is not None, f"rank {rank} trained: {res}"
        assert "parameter 'shift'" in res.error and "every_step" not in res.error, res.error
        assert res.steps == 2, f"rank {rank}: refused after {res.steps} updates, expected 2"


@pytest.mark.parametrize("check", ["first_step", "every_step"])
def test_unchanging_branches_train_as_one_process(check):
    ref = _switching_run(switch_at=None)
    assert ref.error is None, ref.error
    for rank, res in enumerate(run_in_processes(_switching_run, 2, check, None, timeout_s=300,
                                                collective_timeout_s=60)):
        assert res.error is None, res.error
        for p, r in zip(res.params, ref.params):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")

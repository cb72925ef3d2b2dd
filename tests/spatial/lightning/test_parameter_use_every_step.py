"""A parameter used on split activations and on replicated values gets each replicated use's share of its gradient
(``spatial.dispatch.parameter_check``): with ``check_parameter_use="every_step"`` (the default) a forward that starts
using a parameter on a replicated value after it met split activations (a data-dependent branch taken from the third
step on) trains as one process.  ``"first_step"`` gives the shares only from the first step's uses on (measured: the
late branch, met only from step 3, ends 4e-2 away from one process after 4 steps: tested to stay a difference).  A
forward whose branches never change trains as on one process under both settings, and so does one that mixes the
uses from the first step under ``"first_step"`` (the check then runs at every step)."""

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

    def __init__(self, switch_at: int | None, both: bool = False) -> None:
        super().__init__()
        self.both = both  # both uses at every step
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
        if late or self.both:
            pooled = pooled + self.shift.flatten()
        return F.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _switching_run(rank=0, world=1, check="every_step", switch_at=2, both=False) -> Fit:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, C, H, W, generator=g), torch.randint(0, 2, (N,), generator=g))
    module = Switching(switch_at, both)
    strategy = SpatialParallelStrategy(spatial_parts=(2, 1), check_parameter_use=check) if world > 1 else "auto"
    return fit(module, DataLoader(data, batch_size=2), devices=world, strategy=strategy, max_steps=4,
               use_distributed_sampler=False, refusal_is_result=True)


def _max_error(res: Fit, ref: Fit) -> float:
    return max(float((p - r).abs().max()) for p, r in zip(res.params, ref.params))


def test_a_later_branch_that_mixes_uses_trains_as_one_process():
    ref = _switching_run(switch_at=2)
    assert ref.error is None, ref.error
    for rank, res in enumerate(run_in_processes(_switching_run, 2, timeout_s=300, collective_timeout_s=60)):
        assert res.error is None and res.steps == 4, f"rank {rank}: {res.error}"
        assert _max_error(res, ref) <= 1e-5, f"rank {rank}: {_max_error(res, ref):.3g} from one process"


def test_first_step_gives_no_share_to_a_use_that_starts_later():
    """The documented limit of ``"first_step"``: the late replicated use is counted once per tile (a negative
    control of the shares: without them the run is this far off)."""
    ref = _switching_run(switch_at=2)
    for res in run_in_processes(_switching_run, 2, "first_step", 2, timeout_s=300, collective_timeout_s=60):
        assert res.error is None, res.error
        assert _max_error(res, ref) > 1e-3, _max_error(res, ref)


def test_first_step_keeps_checking_a_model_that_mixes_from_the_start():
    ref = _switching_run(switch_at=None, both=True)
    for res in run_in_processes(_switching_run, 2, "first_step", None, True, timeout_s=300,
                                collective_timeout_s=60):
        assert res.error is None, res.error
        assert _max_error(res, ref) <= 1e-5, _max_error(res, ref)


@pytest.mark.parametrize("check", ["first_step", "every_step"])
def test_unchanging_branches_train_as_one_process(check):
    ref = _switching_run(switch_at=None)
    assert ref.error is None, ref.error
    for rank, res in enumerate(run_in_processes(_switching_run, 2, check, None, timeout_s=300,
                                                collective_timeout_s=60)):
        assert res.error is None, res.error
        for p, r in zip(res.params, ref.params):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")

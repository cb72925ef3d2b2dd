"""One overflow verdict for every rank of a split model (``lightning_hpc/distributed/overflow.py``): a rank whose
block of the parameters overflowed makes every rank's ``GradScaler`` skip the step and lower its scale, as one
process skips it; without the agreement the other ranks step (the negative control below).  Under multigrid
(whose ranks hold different residual steps) the strategy installs the agreeing scaler for the run and hands the
user's back with the state it reached."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.overflow import agree_on_overflow, restore_scaler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multigrid"))


def _one_step(rank: int, world: int, agree: bool) -> tuple[float, float, bool]:
    """A scaled step where only rank 1's block overflowed: (this rank's parameter after, its scale after, whether
    the user's scaler came back)."""
    plugin = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    user = plugin.scaler
    original = agree_on_overflow(plugin, "cpu") if agree else None
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    plugin.scaler.scale(p.sum()).backward()
    if rank == 1:
        p.grad[0] = float("inf")  # this rank's block overflowed
    plugin.scaler.unscale_(opt)
    plugin.scaler.step(opt)
    plugin.scaler.update()
    scale = float(plugin.scaler.get_scale())
    restore_scaler(plugin, original)
    back = plugin.scaler is user and float(user.get_scale()) == scale
    return float(p.detach()[1]), scale, back


def test_one_ranks_overflow_skips_every_ranks_step():
    for rank, (value, scale, back) in enumerate(run_in_processes(_one_step, 2, True)):
        assert value == 1.0 and scale == 2.0, (rank, value, scale)  # skipped, scale halved: as one process
        assert back, rank
    # negative control: each rank on its own verdict, rank 0 takes the step rank 1 skips
    (v0, s0, _), (v1, s1, _) = run_in_processes(_one_step, 2, False)
    assert v0 != 1.0 and s0 == 4.0 and v1 == 1.0 and s1 == 2.0


def test_agreement_leaves_a_disabled_or_absent_scaler_alone():
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False)):
        plugin = SimpleNamespace(scaler=scaler)
        assert agree_on_overflow(plugin, "cpu") is None and plugin.scaler is scaler


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.types: set[str] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.types.add(type(trainer.precision_plugin.scaler).__name__)


def _multigrid_fit(rank: int, world: int) -> tuple[set[str], bool, float]:
    from mg_lightning_workers import BATCH, data, user_odenet
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import MultigridStrategy
    from tests.fit_harness import fit

    xs, ys = data(2)
    module = user_odenet().float()
    scaler, seen = torch.amp.GradScaler("cpu", init_scale=2.0**8), _Seen()
    run = fit(module, DataLoader(TensorDataset(xs.float(), ys), batch_size=BATCH), devices=world,
              strategy=MultigridStrategy(mode="pm"), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
              callbacks=[seen], max_steps=2, use_distributed_sampler=False)
    assert run.error is None, run.error
    return seen.types, run.trainer.precision_plugin.scaler is scaler, float(scaler.get_scale())


def test_multigrid_installs_the_agreeing_scaler_and_hands_the_users_back():
    results = run_in_processes(_multigrid_fit, 2)
    for types, back, _ in results:
        assert types == {"ShardedGradScaler"} and back, (types, back)
    assert results[0][2] == results[1][2]  # one verdict: the ranks' scales never part

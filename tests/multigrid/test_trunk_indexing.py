"""While the trunk is split (``strategy='multigrid'`` replaces the user's ``nn.Sequential`` of steps by this rank's
share), indexing it reads as the user's ``nn.Sequential`` of every step: ``len`` is the number of steps, ``trunk[i]``
and slices are step ``i`` of the whole trunk (never this rank's ``i``-th own step), and a step another rank holds
is refused naming the rank that holds it, as is an index out of range."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models.ode_resnet import ResidualStep
from lightning_hpc.multigrid.sharded import LayerShardedTrunk

STEPS = 8


def _steps() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[ResidualStep(nn.Linear(3, 3).double(), 0.25) for _ in range(STEPS)])


def _first_weight(module: nn.Module) -> torch.Tensor:
    return next(module.parameters()).detach().clone()


def _ranks(rank: int, world: int) -> dict:
    full = _steps()
    serial = {i: _first_weight(full[i]) for i in range(STEPS)}
    trunk = LayerShardedTrunk(full, torch.distributed.group.WORLD, 2, 1)
    out: dict = {"len": len(trunk), "same": {}, "refused": {}}
    for i in [*range(STEPS), -1, -STEPS]:
        try:
            out["same"][i] = torch.equal(_first_weight(trunk[i]), serial[i % STEPS])
        except IndexError as e:
            out["refused"][i] = str(e)
    own = slice(4 * rank, 4 * rank + 4)
    out["own_slice"] = [torch.equal(_first_weight(m), serial[4 * rank + j]) for j, m in enumerate(trunk[own])]
    try:
        trunk[2:6]
    except IndexError as e:
        out["across"] = str(e)
    with pytest.raises(IndexError, match="out of range: the trunk has 8 residual steps"):
        trunk[STEPS]
    out["iterated"] = len(list(trunk))  # iteration is this rank's own steps, as parameters() is
    return out


def test_indexing_a_split_trunk_reads_as_the_users_sequential():
    for rank, got in enumerate(run_in_processes(_ranks, 2)):
        own = range(4 * rank, 4 * rank + 4)
        assert got["len"] == STEPS and got["iterated"] == 4, rank
        assert got["same"] == {i: True for i in [*range(STEPS), -1, -STEPS] if i % STEPS in own}, rank
        other = 1 - rank
        for i, message in got["refused"].items():
            assert i % STEPS not in own, (rank, i)
            assert f"held by layer rank {other}" in message and f"holds steps {own[0]}..{own[-1]}" in message
        assert got["own_slice"] == [True] * 4, rank
        assert f"held by layer rank {other}" in got["across"], rank


def test_one_process_trunk_indexes_as_the_users_sequential():
    full = _steps()
    trunk = LayerShardedTrunk(full, None, 2, 1)
    assert len(trunk) == len(full)
    assert all(trunk[i] is full[i] for i in range(-STEPS, STEPS))
    assert list(trunk[1:7:2]) == list(full[1:7:2])


def test_trainer_fit_reads_the_users_step_or_refuses_before_the_first_step():
    """Through ``Trainer.fit`` (a user's ODE-ResNet, 16 steps over 2 layer ranks): ``self.model.steps[-1]`` read in
    ``on_before_optimizer_step`` is refused on rank 0 before its first optimizer step, naming rank 1, which holds
    it, and every rank ends with that message; likewise ``steps[5]`` on rank 1.  One process reads step 5."""
    from mg_lightning_workers import NUM_STEPS, multigrid_indexing

    serial = user_odenet_first_weights()
    last = run_in_processes(multigrid_indexing, 2, -1, timeout_s=300, collective_timeout_s=120)
    # rank 0 refuses before its step; rank 1, which holds step 15, ends with rank 0's message (its own step
    # may have been taken before the failure reached it: the refusal is the reading rank's)
    assert "held by layer rank 1" in last[0]["error"] and last[0]["global_step"] == 0, last[0]
    assert "rank 0: IndexError: residual step 15" in last[1].get("error", ""), last[1]
    fifth = run_in_processes(multigrid_indexing, 2, 5, timeout_s=300, collective_timeout_s=120)
    assert "held by layer rank 0" in fifth[1]["error"] and fifth[1]["global_step"] == 0, fifth[1]
    assert "rank 1: IndexError: residual step 5" in fifth[0].get("error", ""), fifth[0]
    single = multigrid_indexing(0, 1, 5)  # one process holds every step
    assert single["len"] == NUM_STEPS and torch.equal(single["weight"], serial[5]), single


def user_odenet_first_weights() -> dict[int, torch.Tensor]:
    from mg_lightning_workers import user_odenet

    model = user_odenet()
    return {i: next(step.parameters()).detach().clone() for i, step in enumerate(model.model.steps)}

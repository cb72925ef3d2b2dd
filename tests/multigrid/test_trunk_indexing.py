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

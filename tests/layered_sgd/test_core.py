"""Layered SGD core (plain torch.distributed): 4 gloo ranks as 2 node groups x 2, against serial SGD and DDP."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.layered_sgd.hierarchical import (
    HierarchicalAllreduce,
    LayeredCommTimeout,
    build_layered_groups,
)
from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate

WORLD, PER_NODE, LOCAL_BATCH, STEPS = 4, 2, 3, 6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.unused = nn.Linear(2, 2)  # never used in forward: must keep grad=None (no weight decay step)
        self.rank_scale = nn.Parameter(torch.ones(3))  # used on even ranks only (see forward)
        self.use_scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        # A parameter that gets a gradient on some ranks only: the bucket holding it becomes ready during
        # backward on those ranks and only at begin() on the others; buckets must still start in the same order.
        return out * self.rank_scale if self.use_scale else out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * WORLD * LOCAL_BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (x.shape[0],), generator=g)
    return x, y


def _optim(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _global_batch(x, y, step):
    n = WORLD * LOCAL_BATCH
    return x[step * n : (step + 1) * n], y[step * n : (step + 1) * n]


def _serial() -> list[torch.Tensor]:
    """Algorithm 1: one process on the concatenated global mini-batch."""
    model, (x, y) = _model(), _data()
    opt, sched = _optim(model)
    for step in range(STEPS):
        xb, yb = _global_batch(x, y, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        sched.step()
    return [p.detach().clone().numpy() for p in model.parameters()]  # numpy: pickled by value


def _layered_worker(rank: int, world: int, per_node: int = PER_NODE, bucket_cap_mb: float = 25.0,
                    rank_dependent: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)  # different seeds: parameters must come from rank 0's broadcast
    model, (x, y) = _model(), _data()
    model.use_scale = rank_dependent and rank % 2 == 0
    opt, sched = _optim(model)
    groups = build_layered_groups(per_node, timeout_s=60)
    # tiny buckets: about one parameter per bucket, started from the gradient hooks during backward
    update = PostponedUpdate(model.parameters(), HierarchicalAllreduce(groups, timeout_s=60),
                             bucket_cap_mb=bucket_cap_mb, first_bucket_mb=min(1.0, bucket_cap_mb))
    for step in range(STEPS):
        xb, yb = _global_batch(x, y, step)
        xb, yb = xb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH], yb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        update.apply(opt.step)  # line 10 of step-1: before this forward
        opt.zero_grad()
        with update.no_sync():  # gradient accumulation: first micro-batch reduces nothing
            nn.functional.cross_entropy(model(xb[:1]), yb[:1]).mul(1 / LOCAL_BATCH).backward()
        nn.functional.cross_entropy(model(xb[1:]), yb[1:]).mul((LOCAL_BATCH - 1) / LOCAL_BATCH).backward()
        update.begin([opt])  # lines 6 and 8
        with warnings.catch_warnings():  # "scheduler stepped before optimizer": intended here
            warnings.simplefilter("ignore", UserWarning)
            sched.step()  # the scheduler moves on before the postponed step: the update must still use the old lr
        time.sleep(0.01)  # "load the next batch" while the leaders allreduce
    update.apply(opt.step)
    update.allreduce.close()
    update.close()
    assert model.unused.weight.grad is None
    return [p.detach().clone().numpy() for p in model.parameters()]  # numpy: pickled by value


def _ddp_worker(rank: int, world: int, rank_dependent: bool = False) -> list[torch.Tensor]:
    model, (x, y) = _model(), _data()
    model.use_scale = rank_dependent and rank % 2 == 0
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt, sched = _optim(model)
    for step in range(STEPS):
        xb, yb = _global_batch(x, y, step)
        xb, yb = xb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH], yb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
        sched.step()
    return [p.detach().clone().numpy() for p in model.parameters()]  # numpy: pickled by value


def _layered_and_ddp_worker(rank: int, world: int):
    return (
        _layered_worker(rank, world),
        _ddp_worker(rank, world),
        _layered_worker(rank, world, bucket_cap_mb=1e-5),  # 2 groups x 2, one bucket per parameter
        _layered_worker(rank, world, per_node=WORLD, bucket_cap_mb=1e-5),  # one group: plain bucketed allreduce
        _layered_worker(rank, world, bucket_cap_mb=1e-5, rank_dependent=True),
        _ddp_worker(rank, world, rank_dependent=True),
    )


def test_layered_equals_serial_and_ddp():
    """Parameters after 6 steps of SGD (momentum, weight decay, StepLR; each step accumulated from 2
    micro-batches, the first under no_sync) in float64: layered == DDP == serial, with one bucket and with one
    bucket per parameter started from the gradient hooks (2 groups x 2 and a single group of 4); and with a
    parameter that gets gradients on even ranks only, layered == DDP(find_unused_parameters=True)."""
    serial = [torch.from_numpy(a) for a in _serial()]
    runs = run_in_processes(_layered_and_ddp_worker, WORLD, timeout_s=300)  # one spawn: the machine is slow
    initial = list(_model().parameters())
    assert any(not torch.allclose(s, i) for s, i in zip(serial, initial)), "training did not move the weights"
    for rank in range(WORLD):
        layered, ddp, small_buckets, one_group, lay_dep, ddp_dep = runs[rank]
        for s, lay, d, sb, og in zip(serial, layered, ddp, small_buckets, one_group):
            for got in (lay, sb, og):
                torch.testing.assert_close(torch.from_numpy(got), s, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(torch.from_numpy(lay), torch.from_numpy(d), rtol=1e-10, atol=1e-10)
        scale = [n for n, _ in _model().named_parameters()].index("rank_scale")  # it moved, as with DDP
        assert not torch.allclose(torch.from_numpy(lay_dep[scale]), initial[scale].detach())
        for a, b in zip(lay_dep, ddp_dep):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-10, atol=1e-10)


def _mean_worker(rank: int, world: int) -> list:
    return [_mean_for(rank, per_node) for per_node in (1, 2, 4)]


def _mean_for(rank: int, per_node: int):
    groups = build_layered_groups(per_node, timeout_s=60)
    reducer = HierarchicalAllreduce(groups, timeout_s=60)
    out = []
    for k in range(3):  # reuse of the communicator thread
        t = torch.arange(10, dtype=torch.float64) * (rank + 1) + k
        reducer.start(t)
        out.append(reducer.finish()[0].clone())
    reducer.close()
    return torch.stack(out).numpy()


def test_hierarchical_mean():
    """Global mean for 4 groups of 1, 2 groups of 2 and 1 group of 4 (no inter-group step)."""
    results = [r for per_rank in run_in_processes(_mean_worker, WORLD, timeout_s=240) for r in per_rank]
    expected = torch.stack(
        [sum(torch.arange(10, dtype=torch.float64) * (r + 1) + k for r in range(WORLD)) / WORLD for k in range(3)]
    )
    for r in results:
        torch.testing.assert_close(torch.from_numpy(r), expected)


def _timeout_worker(rank: int, world: int) -> str:
    groups = build_layered_groups(PER_NODE, timeout_s=3)
    reducer = HierarchicalAllreduce(groups, timeout_s=2)
    if rank == 2:  # the leader of node group 1 never reaches the step (its peers time out first)
        time.sleep(5)
        return "skipped"
    try:
        reducer.start(torch.ones(4))
        reducer.finish()
    except LayeredCommTimeout as e:
        return str(e)
    return "no error"


def test_timeout_names_group_and_rank():
    out = run_in_processes(_timeout_worker, WORLD, timeout_s=120, collective_timeout_s=3)
    assert "step 2" in out[0] and "rank 0 of 4" in out[0] and "node group 0 of 2" in out[0], out[0]
    assert "rank 3 of 4" in out[3] and "node group 1 of 2" in out[3], out[3]


class _FakeWorld(TorchDistributedCommunicator):
    @property
    def world_size(self) -> int:
        return 6

    @property
    def rank(self) -> int:
        return 0


def test_bad_topology_names_both_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by procs_per_node=4"):
        build_layered_groups(4, _FakeWorld())


"""Layered SGD (Yu et al., Algorithm 3) on a given Communicator vs synchronous SGD in one process.

4 ranks as 2 node groups x 2 (Horovod process sets under HorovodCommunicator): hierarchical gradient
allreduce (reduce to the group leader, leaders' allreduce on the communicator thread, broadcast back) and the
postponed update, for 6 steps of SGD with momentum, weight decay and StepLR in float64.  ``serial()`` is
Algorithm 1 on the concatenated global batch.  ``main(OUT)`` (run_cases.py) or ``python layered_case.py OUT``
under ``horovodrun -np 4 --gloo`` writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lightning_hpc.distributed.comm import Communicator
from lightning_hpc.layered_sgd.hierarchical import HierarchicalAllreduce, build_layered_groups
from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate

WORLD, PER_NODE, LOCAL_BATCH, STEPS = 4, 2, 3, 6


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * WORLD * LOCAL_BATCH, 5, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (x.shape[0],), generator=g)


def optim(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-2)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def global_batch(x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = WORLD * LOCAL_BATCH
    return x[step * n : (step + 1) * n], y[step * n : (step + 1) * n]


def serial() -> list[np.ndarray]:
    """Algorithm 1: synchronous SGD in one process on the global mini-batch."""
    net, (x, y) = model(), data()
    opt, sched = optim(net)
    for step in range(STEPS):
        xb, yb = global_batch(x, y, step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
        sched.step()
    return [p.detach().clone().numpy() for p in net.parameters()]


def layered(comm: Communicator) -> dict[str, object]:
    rank = comm.rank
    net, (x, y) = model(), data()
    opt, sched = optim(net)
    groups = build_layered_groups(PER_NODE, comm, timeout_s=120)
    update = PostponedUpdate(net.parameters(), HierarchicalAllreduce(groups, comm, timeout_s=120))
    for step in range(STEPS):
        xb, yb = global_batch(x, y, step)
        xb, yb = xb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH], yb[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        update.apply(opt.step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        update.begin([opt])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            sched.step()
        time.sleep(0.01)  # "load the next batch" while the leaders allreduce on the communicator thread
    update.apply(opt.step)
    update.allreduce.close()
    # Horovod shuts down on every rank once one rank exits: a group that finishes its last process-set
    # broadcast first must not leave while the other group's is still in flight.
    comm.barrier()
    return {
        "params": [p.detach().clone().numpy() for p in net.parameters()],
        "intra_group": type(groups.intra).__name__,
        "leaders_group": type(groups.leaders).__name__ if groups.leaders is not None else None,
    }


def main(out: Path) -> None:
    torch.set_num_threads(1)
    from lightning_hpc.distributed import get_communicator

    comm = get_communicator("horovod")
    result = layered(comm)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

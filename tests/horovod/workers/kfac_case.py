"""K-FAC (SC20) with its collectives on a given Communicator: the same few steps on any backend.

``train(rank, world, comm, placement)`` runs K-FAC-preconditioned SGD on a small CNN for a few steps, each
rank on its slice of a fixed global batch, gradients averaged through ``comm`` (what the strategy does), and
returns the final parameters.  ``torch_case`` runs it on torch.distributed (via run_in_processes);
``main(OUT)`` (run_cases.py) or ``python kfac_case.py OUT`` under ``horovodrun -np N --gloo`` runs it on Horovod
and writes OUT/rank{r}.pt.
Each placement runs once, and ``balanced`` once more with the factor all-reduce launched from the backward hooks
(``overlap_factor_allreduce``, key ``"balanced+overlap"``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator
from lightning_hpc.kfac import PLACEMENTS, KFACPreconditioner

STEPS, GLOBAL_BATCH = 6, 16


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 3 * 3, 12), nn.ReLU(), nn.Linear(12, 5),
    )  # fmt: skip


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 2, 7, 7, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def train(rank: int, world: int, comm: Communicator, placement: str, overlap: bool = False) -> list[np.ndarray]:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(
        net, optimizer=opt, factor_update_freq=2, inv_update_freq=4, damping=0.05, kl_clip=0.01,
        placement=placement, communicator=comm, overlap_factor_allreduce=overlap,
    )  # fmt: skip
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        for p in net.parameters():  # the strategy's gradient average
            comm.allreduce(p.grad, op="mean")
        pre.step()
        opt.step()
    # numpy: results cross process boundaries by value
    return [p.detach().clone().numpy() for p in net.parameters()]


def cases(rank: int, world: int, comm: Communicator) -> dict[str, list[np.ndarray]]:
    out = {placement: train(rank, world, comm, placement) for placement in PLACEMENTS}
    out["balanced+overlap"] = train(rank, world, comm, "balanced", overlap=True)
    return out


def torch_case(rank: int, world: int) -> dict[str, list[np.ndarray]]:
    torch.set_num_threads(1)
    return cases(rank, world, TorchDistributedCommunicator())


def main(out: Path) -> None:
    torch.set_num_threads(1)
    from lightning_hpc.distributed import get_communicator

    comm = get_communicator("horovod")
    result = cases(comm.rank, comm.world_size, comm)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

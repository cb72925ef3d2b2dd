"""The same sequence of collectives through any :class:`Communicator`, for comparing backends.

``exercise(comm)`` needs 4 ranks.  ``torch_case`` runs it on torch.distributed (via run_in_processes);
``main(OUT)`` (run_cases.py) or ``python collectives.py OUT`` under ``horovodrun -np 4 --gloo`` runs it on Horovod
and writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator


def _data(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g).to(dtype)


def exercise(comm: Communicator) -> dict[str, object]:
    rank, world = comm.rank, comm.world_size
    assert world == 4, f"the collectives case needs 4 ranks, got {world}"
    out: dict[str, object] = {"rank": rank, "world_size": world}

    x = _data(rank, (5, 3), salt=1)
    comm.allreduce(x, op="mean")
    out["allreduce_mean"] = x

    x = _data(rank, (7,), torch.float64, salt=2)
    handle = comm.allreduce(x, op="sum", async_op=True)
    handle.wait()
    out["allreduce_sum_async_f64"] = x

    # several allreduces in flight at once (Horovod fuses them), waited in reverse order
    xs = [_data(rank, (n,), salt=10 + n) for n in (1, 100, 1000)]
    handles = [comm.allreduce(t, op="mean", async_op=True) for t in xs]
    for h in reversed(handles):
        h.wait()
    out["allreduce_many"] = torch.cat(xs)

    x = _data(rank, (4, 2), salt=3)
    comm.broadcast(x, src=2)
    out["broadcast_src2"] = x

    out["allgather_world"] = torch.stack(comm.allgather(_data(rank, (2, 3), salt=4)))

    # groups: {0,1} and {2,3} (every rank creates both, like torch.distributed.new_group), leaders {0,2}
    g01, g23, leaders = comm.new_group([0, 1]), comm.new_group([2, 3]), comm.new_group([0, 2])
    mine = g01 if rank < 2 else g23
    out["group_size"] = comm.group_size(mine)
    x = _data(rank, (6,), salt=5)
    comm.allreduce(x, op="sum", group=mine)
    out["group_allreduce_sum"] = x
    x = _data(rank, (6,), salt=6)
    comm.allreduce(x, op="mean", group=mine, async_op=True).wait()
    out["group_allreduce_mean_async"] = x
    x = _data(rank, (3,), salt=7)
    comm.broadcast(x, src=1 if rank < 2 else 3, group=mine)  # global source rank, not the rank in the group
    out["group_broadcast"] = x
    out["group_allgather"] = torch.stack(comm.allgather(_data(rank, (2,), salt=8), group=mine))
    if rank in (0, 2):
        x = _data(rank, (4,), salt=9)
        comm.allreduce(x, op="sum", group=leaders)
        out["leaders_allreduce"] = x
        x = _data(rank, (4,), salt=10)
        comm.broadcast(x, src=2, group=leaders)
        out["leaders_broadcast"] = x
    comm.barrier(mine)
    comm.barrier()
    return out


def torch_case(rank: int, world_size: int) -> dict[str, object]:
    # tensors go back as numpy arrays: torch.multiprocessing would pass them as shared-memory file
    # descriptors, which vanish when this process exits before the parent has read the result
    out = exercise(TorchDistributedCommunicator())
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    from lightning_hpc.distributed import get_communicator

    comm = get_communicator("horovod")
    result = exercise(comm)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{comm.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

import pytest
import torch
import torch.distributed as dist

from lightning_hpc.distributed import check_divisible, node_groups, run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator, get_communicator


def _collectives(rank: int, world_size: int) -> dict:
    comm = TorchDistributedCommunicator()
    out = {}
    t = torch.tensor([float(rank + 1), 2.0 * rank])
    comm.allreduce(t, op="mean")
    out["mean"] = t.tolist()
    t = torch.tensor([float(rank + 1)])
    h = comm.allreduce(t, op="sum", async_op=True)
    h.wait()
    out["sum"] = t.item()
    b = torch.tensor([float(rank)])
    comm.broadcast(b, src=world_size - 1)
    out["bcast"] = b.item()
    out["gather"] = [x.item() for x in comm.allgather(torch.tensor([rank * 10.0]))]
    # a subgroup of the even ranks
    evens = comm.new_group(range(0, world_size, 2))
    if rank % 2 == 0:
        s = torch.tensor([float(rank)])
        comm.allreduce(s, op="sum", group=evens)
        out["evens"] = s.item()
    comm.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_communicator_matches_expected_values(world_size):
    results = run_in_processes(_collectives, world_size)
    n = world_size
    for rank, out in enumerate(results):
        assert out["mean"] == pytest.approx([(n + 1) / 2, (n - 1)])
        assert out["sum"] == n * (n + 1) / 2
        assert out["bcast"] == n - 1
        assert out["gather"] == [10.0 * r for r in range(n)]
        if rank % 2 == 0:
            assert out["evens"] == sum(range(0, n, 2))


def _node_groups(rank: int, world_size: int) -> tuple:
    ng = node_groups(2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ng.intra)
    lead = None
    if ng.leaders is not None:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=ng.leaders)
        lead = x.item()
    return ng.group_index, ng.leader_rank, ng.is_leader, t.item(), lead


def test_node_groups_two_by_two():
    res = run_in_processes(_node_groups, 4)
    assert [r[:3] for r in res] == [(0, 0, True), (0, 0, False), (1, 2, True), (1, 2, False)]
    assert [r[3] for r in res] == [1.0, 1.0, 5.0, 5.0]
    assert [r[4] for r in res] == [2.0, None, 2.0, None]


def test_check_divisible_message_names_setting():
    check_divisible(8, 4, what="x", setting="procs_per_node")
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by procs_per_node=4"):
        check_divisible(6, 4, what="ranks per node group", setting="procs_per_node")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown communication backend"):
        get_communicator("mpi4py")

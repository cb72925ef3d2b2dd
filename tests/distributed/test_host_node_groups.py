"""Node groups of layered SGD follow the hosts the ranks run on (a cyclic rank -> host placement included)."""

import socket
from unittest import mock

import pytest
import torch

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.groups import gather_hostnames, hosts_layout, node_groups
from lightning_hpc.layered_sgd.hierarchical import HierarchicalAllreduce, build_layered_groups


def test_hosts_layout_blocks_and_cyclic():
    assert hosts_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert hosts_layout(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert hosts_layout(["b", "a", "a", "b", "c", "c"]) == [[0, 3], [1, 2], [4, 5]]
    assert hosts_layout(["a"] * 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="different numbers of ranks"):
        hosts_layout(["a", "a", "a", "b"])


def _cyclic(rank: int, world_size: int) -> dict:
    # Ranks 0, 2 on "host0" and 1, 3 on "host1", as `srun --distribution=cyclic` places them on 2 nodes.
    with mock.patch.object(socket, "gethostname", return_value=f"host{rank % 2}"):
        hosts = gather_hostnames()
    layout = hosts_layout(hosts)
    ng = node_groups(2, layout=layout)
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=ng.intra)
    lg = build_layered_groups(2, layout=layout)
    mean = HierarchicalAllreduce(lg).allreduce_mean(torch.tensor([float(rank + 1)]))
    return {"hosts": hosts, "layout": layout, "index": ng.group_index, "leader": ng.leader_rank,
            "members": ng.members, "intra_sum": t.item(), "layered": (lg.group_index, lg.leader_rank, lg.members),
            "describe": lg.describe(), "mean": mean.item()}


def test_cyclic_placement_groups_ranks_by_host():
    res = run_in_processes(_cyclic, 4)
    assert res[0]["hosts"] == ["host0", "host1", "host0", "host1"]
    assert all(r["layout"] == [[0, 2], [1, 3]] for r in res)
    assert [(r["index"], r["leader"], r["members"]) for r in res] == [
        (0, 0, (0, 2)), (1, 1, (1, 3)), (0, 0, (0, 2)), (1, 1, (1, 3))]
    # The intra-node reduction sums the ranks of the same host, not a contiguous block.
    assert [r["intra_sum"] for r in res] == [2.0, 4.0, 2.0, 4.0]
    assert [r["layered"] for r in res] == [(0, 0, (0, 2)), (1, 1, (1, 3)), (0, 0, (0, 2)), (1, 1, (1, 3))]
    assert "ranks 0, 2, leader 0" in res[2]["describe"]
    assert all(r["mean"] == 2.5 for r in res)


def test_a_layout_must_split_the_ranks_into_equal_groups():
    from lightning_hpc.distributed.groups import check_layout

    assert check_layout([[3, 1], [2, 0]], 4) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="does not split ranks"):
        check_layout([[0, 1], [1, 2]], 4)
    with pytest.raises(ValueError, match="does not split ranks"):
        check_layout([[0, 1, 2], [3]], 4)

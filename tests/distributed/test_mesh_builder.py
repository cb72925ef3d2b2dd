"""The one topology builder (``build_mesh``): validation names the setting to change; any rank placement works,
with the world's timeout on every group and groups of the mesh's own (never the world group)."""

import pytest
import torch
import torch.distributed as dist

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.groups import (
    DEFAULT_TIMEOUT_S,
    MeshDim,
    _backend_config,
    build_mesh,
    group_timeout,
    mesh_from_new_groups,
    mesh_ranks,
    mesh_sizes,
    node_groups,
)

WORLD_TIMEOUT_S = 45.0


def test_sizes_resolve_the_remaining_dimension():
    assert mesh_sizes(8, [MeshDim("data"), MeshDim("layer", 4)]) == (2, 4)
    assert mesh_sizes(8, [MeshDim("head")]) == (8,)
    assert mesh_sizes(6, [MeshDim("a", 2), MeshDim("b", 3)]) == (2, 3)
    assert mesh_ranks(4, [MeshDim("a"), MeshDim("b", 2)]).tolist() == [[0, 1], [2, 3]]


def test_validation_errors_name_the_setting():
    tile = MeshDim("tile", 3, setting="spatial_parts=3x1=3", what="ranks per sample")
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by spatial_parts=3x1=3 \(ranks per sample\);"
                                         r" use a world size that is a multiple of 3, or change spatial_parts$"):
        mesh_sizes(4, [MeshDim("sample"), tile])
    with pytest.raises(ValueError, match=r"layer_parallel_size=0: must be a positive integer"):
        mesh_sizes(4, [MeshDim("data"), MeshDim("layer", 0, setting="layer_parallel_size=0")])
    with pytest.raises(ValueError, match=r"2 x 3 = 6 ranks does not match world size 4.*change a or b"):
        mesh_sizes(4, [MeshDim("a", 2), MeshDim("b", 3)])
    with pytest.raises(ValueError, match="only one mesh dimension"):
        mesh_sizes(4, [MeshDim("a"), MeshDim("b")])
    with pytest.raises(ValueError, match="distinct dimension names"):
        mesh_sizes(4, [MeshDim("a", 2), MeshDim("a", 2)])
    with pytest.raises(ValueError, match="does not place ranks 0..3 once each"):
        mesh_ranks(4, [MeshDim("a", 2), MeshDim("b", 2)], [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="does not place ranks 0..3 once each"):
        mesh_ranks(4, [MeshDim("a", 2), MeshDim("b", 2)], [[0, 1, 2, 3]])


def _non_contiguous(rank: int, world_size: int) -> dict:
    # ranks 0, 2 on one host and 1, 3 on the other (srun --distribution=cyclic): one row per host
    mesh = build_mesh([MeshDim("node"), MeshDim("local", 2)], ranks=[[0, 2], [1, 3]])
    local, node = mesh.get_group("local"), mesh.get_group("node")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=local)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=node)
    # a dimension spanning the whole world is a group of its own, with the world's timeout
    head = build_mesh([MeshDim("head")]).get_group("head")
    ng = node_groups(2, layout=[[0, 2], [1, 3]])
    # the route taken when the world group is bound to a device (CUDA) and a dimension is not NCCL
    cfg = _backend_config("cpu", None, group_timeout())
    own = mesh_from_new_groups("cpu", torch.tensor([[0, 2], [1, 3]]), ("node", "local"), [cfg, cfg])
    v = torch.tensor([float(rank)])
    dist.all_reduce(v, group=own.get_group("local"))
    leaders = None
    if ng.leaders is not None:
        leaders = dist.get_process_group_ranks(ng.leaders)
    return {
        "local": dist.get_process_group_ranks(local), "node": dist.get_process_group_ranks(node),
        "local_sum": t.item(), "node_sum": u.item(),
        "own_local": dist.get_process_group_ranks(own.get_group("local")),
        "own_node": dist.get_process_group_ranks(own.get_group("node")), "own_local_sum": v.item(),
        "own_timeout": group_timeout(own.get_group("local")).total_seconds(),
        "timeouts": [group_timeout(g).total_seconds() for g in (local, node, head)],
        # node groups take layered SGD's timeout (default: DEFAULT_TIMEOUT_S), as before they were a mesh
        "node_timeouts": [group_timeout(g).total_seconds() for g in (ng.intra, ng.leaders) if g is not None],
        "head_is_world": head is dist.group.WORLD or head == dist.distributed_c10d._get_default_group(),
        "head_ranks": dist.get_process_group_ranks(head),
        "intra": dist.get_process_group_ranks(ng.intra), "leaders": leaders,
        "leader_backend": dist.get_backend(ng.leaders) if ng.leaders is not None else None,
    }


def test_non_contiguous_host_layout_and_timeouts():
    res = run_in_processes(_non_contiguous, 4, collective_timeout_s=WORLD_TIMEOUT_S)
    assert [r["local"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["node"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["local_sum"] for r in res] == [2.0, 4.0, 2.0, 4.0]
    assert [r["node_sum"] for r in res] == [1.0, 1.0, 5.0, 5.0]
    assert [r["own_local"] for r in res] == [r["local"] for r in res]
    assert [r["own_node"] for r in res] == [r["node"] for r in res]
    assert [r["own_local_sum"] for r in res] == [2.0, 4.0, 2.0, 4.0]
    assert all(r["own_timeout"] == WORLD_TIMEOUT_S for r in res)
    assert all(t == WORLD_TIMEOUT_S for r in res for t in r["timeouts"]), [r["timeouts"] for r in res]
    assert all(t == DEFAULT_TIMEOUT_S for r in res for t in r["node_timeouts"])
    assert [len(r["node_timeouts"]) for r in res] == [2, 2, 1, 1]
    assert all(not r["head_is_world"] and r["head_ranks"] == [0, 1, 2, 3] for r in res)
    assert [r["intra"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["leaders"] for r in res] == [[0, 1], [0, 1], None, None]
    assert res[0]["leader_backend"] == "gloo"

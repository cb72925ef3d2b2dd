"""Sub-groups fail as fast as the world's collective timeout (the strategy's ``timeout``), not after 30 minutes.

torch gives ``new_group`` (and a DeviceMesh's groups, unless ``backend_override`` carries options) its own 30-minute
default whatever timeout the world was initialised with; the hybrid_fc head group and the multigrid data x layer
mesh were built that way, so a rank stuck outside a collective hung the job for 30 minutes (measured with hybrid_fc:
killed by the outer 300 s limit, while ddp/layered_sgd/spatial ended 8 s after their 20 s timeout; an all_reduce on
such a group with a stuck peer waited 8.0 s, until the peer exited, under a 2 s world timeout)."""

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.distributed.groups import group_timeout, mesh_2d, new_group
from lightning_hpc.hybrid_fc.parallel import _same_ranks_group
from lightning_hpc.multigrid.parallel import layer_data_groups

WORLD_TIMEOUT_S = 45.0  # short enough to tell from torch's 1800 s, long enough for a slow process start


def _timeouts(rank: int, world_size: int) -> dict[str, float]:
    data, layer, _, _ = layer_data_groups(1)  # 2 (data) x 1 (layer): the data group spans both ranks
    mesh = mesh_2d(1, 2, ("outer", "inner"))
    outer, inner = mesh.get_group("outer"), mesh.get_group("inner")
    mesh_t = mesh_2d(2, 1, ("outer", "inner"))
    head = new_group([0, 1])
    groups = {
        "world": None,
        "new_group": head,
        "mesh_inner": inner,
        "mesh_outer": outer,
        "mesh_2x1_outer": mesh_t.get_group("outer"),
        "multigrid_data": data,
        "multigrid_layer": layer,
        "hybrid_exchange": _same_ranks_group(head),
        "communicator": TorchDistributedCommunicator().new_group([0, 1]),
    }
    return {name: group_timeout(g).total_seconds() for name, g in groups.items()}


def test_sub_groups_inherit_the_world_timeout():
    out = run_in_processes(_timeouts, 2, collective_timeout_s=WORLD_TIMEOUT_S)
    for per_rank in out:
        assert per_rank == {name: WORLD_TIMEOUT_S for name in per_rank}, per_rank

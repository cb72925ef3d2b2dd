"""Process groups and device meshes shared by every strategy.

The hierarchy used by layered SGD (ranks grouped into nodes, one leader per node) and the 2-D meshes used by
the hybrid, spatial and multigrid strategies are built here, once, on top of torch.distributed and
DeviceMesh.  Every function must be called by *all* ranks of the world group (torch.distributed requires
every rank to take part in creating every group).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_hpc._compat import process_group_timeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "default_timeout",
    "NodeGroups",
    "check_divisible",
    "check_layout",
    "contiguous_layout",
    "node_groups",
    "gather_hostnames",
    "hosts_layout",
    "local_world_size_from_env",
    "mesh_2d",
    "group_timeout",
    "new_group",
]

#: Collectives that do not complete in this time raise instead of hanging (overridable per strategy).
DEFAULT_TIMEOUT_S = float(os.environ.get("LIGHTNING_HPC_TIMEOUT_S", "600"))


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout ``group`` (default: the world group) was created with, or ``None`` if unknown.

    Read from the group's backend options (no public getter exists); ``None`` when the backend does not expose
    them, so callers fall back to torch's default.
    """
    return process_group_timeout(group)


def new_group(
    ranks: list[int], *, backend: str | None = None, timeout: datetime.timedelta | None = None
) -> dist.ProcessGroup:
    """``torch.distributed.new_group`` whose timeout defaults to the world group's.

    torch gives a new group its own default (30 minutes) whatever ``timeout`` the strategy initialised the
    world with, so a dead or stuck peer would hang a collective on such a group for 30 minutes even when the
    user asked for a short timeout.  Collective: every rank of the world calls it with the same ``ranks``.
    """
    return dist.new_group(list(ranks), backend=backend, timeout=timeout or group_timeout())


def check_divisible(world_size: int, parts: int, *, what: str, setting: str) -> None:
    """Raise a ValueError naming ``setting`` when ``world_size`` is not a multiple of ``parts``."""
    if parts <= 0:
        raise ValueError(f"{setting}={parts}: must be a positive integer")
    if world_size % parts != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by {setting}={parts} ({what}); "
            f"use a world size that is a multiple of {parts}, or change {setting}"
        )


def local_world_size_from_env() -> int | None:
    """Processes per node as the launcher (torchrun, SLURM, Lightning, Horovod) reports it, if it does."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE"):
        value = os.environ.get(key)
        if value:
            try:
                return int(value.split("(")[0])
            except ValueError:
                continue
    return None


def gather_hostnames(group: dist.ProcessGroup | None = None) -> list[str]:
    """``socket.gethostname()`` of every rank of ``group`` (default: the world), indexed by rank.  Collective."""
    out: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, socket.gethostname(), group=group)
    return [str(h) for h in out]


def hosts_layout(hosts: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by the host they run on: ``hosts[r]`` is rank r's host.  One ascending list per host,
    hosts ordered by their lowest rank, e.g. ``["a", "b", "a", "b"]`` (a cyclic placement) -> ``[[0, 2], [1, 3]]``.
    Raises ValueError when the hosts run different numbers of ranks (node groups must be equal)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    layout = list(by_host.values())
    sizes = {len(g) for g in layout}
    if len(sizes) > 1:
        counts = ", ".join(f"{h}: {len(r)}" for h, r in by_host.items())
        raise ValueError(f"layered SGD node groups: the hosts run different numbers of ranks ({counts}); "
                         "launch the same number of processes on every node, or set procs_per_node")
    return layout


@dataclass
class NodeGroups:
    """Ranks split into groups of ``group_size`` ("nodes"), each led by its lowest rank: contiguous blocks, or
    the ``layout`` given to :func:`node_groups` (e.g. the ranks of each host, see :func:`hosts_layout`).

    ``intra`` is this rank's node group; ``leaders`` holds the group leaders (``None`` on other ranks);
    ``leader_rank`` is the global rank of this rank's leader.
    """

    group_size: int
    num_groups: int
    group_index: int
    leader_rank: int
    intra: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    #: the ranks of this rank's group, ascending
    members: tuple[int, ...] = ()

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader_rank


def contiguous_layout(world_size: int, group_size: int) -> list[list[int]]:
    """``[[0 .. g-1], [g .. 2g-1], ...]``: node groups as contiguous rank blocks."""
    check_divisible(world_size, group_size, what="ranks per node group", setting="procs_per_node")
    return [list(range(g, g + group_size)) for g in range(0, world_size, group_size)]


def check_layout(layout: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """``layout`` as sorted lists, checked to split ``range(world_size)`` into equal groups."""
    groups = [sorted(int(r) for r in g) for g in layout]
    if sorted(r for g in groups for r in g) != list(range(world_size)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"node group layout {groups} does not split ranks 0..{world_size - 1} into equal groups")
    return sorted(groups)


def node_groups(
    group_size: int,
    *,
    intra_backend: str | None = None,
    leader_backend: str | None = "gloo",
    timeout: datetime.timedelta | None = None,
    layout: Sequence[Sequence[int]] | None = None,
) -> NodeGroups:
    """Create the node hierarchy: one group per node and one group of node leaders.

    ``layout`` lists the ranks of each node (default: contiguous blocks of ``group_size``); each group is led by
    its lowest rank.  ``intra_backend`` defaults to the world backend (NCCL on GPUs); the leader group defaults
    to gloo so the inter-node step can be driven from a CPU thread, as the layered-SGD paper's CPU
    communicators are.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = check_layout(layout, world) if layout is not None else contiguous_layout(world, group_size)
    timeout = timeout or default_timeout()
    mine, index = None, -1
    for g, ranks in enumerate(groups):
        pg = dist.new_group(ranks, backend=intra_backend, timeout=timeout)
        if rank in ranks:
            mine, index = pg, g
    leader_ranks = [ranks[0] for ranks in groups]
    leaders = dist.new_group(leader_ranks, backend=leader_backend, timeout=timeout)
    assert mine is not None
    return NodeGroups(
        group_size=len(groups[0]),
        num_groups=len(groups),
        group_index=index,
        leader_rank=groups[index][0],
        intra=mine,
        leaders=leaders if rank in leader_ranks else None,
        members=tuple(groups[index]),
    )


def _backend_options(device_type: str, timeout: datetime.timedelta) -> tuple[str, Any] | None:
    """(backend name, options carrying ``timeout``) of the world's backend for ``device_type``, for a
    DeviceMesh's ``backend_override``; None for a backend whose options we cannot build."""
    spec = str(dist.get_backend())  # "gloo", "nccl" or "cpu:gloo,cuda:nccl"
    pairs = dict(p.split(":", 1) for p in spec.split(",")) if ":" in spec else {device_type: spec}
    name = pairs.get(device_type)
    if name == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lacks _Options (runtime class)
    elif name == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    opts._timeout = timeout
    return name, opts


def mesh_2d(outer: int, inner: int, names: tuple[str, str], device_type: str = "cpu", timeout: datetime.timedelta | None = None):
    """A 2-D DeviceMesh of shape ``(outer, inner)``; ``outer * inner`` must equal the world size.

    Rank r sits at ``(r // inner, r % inner)``: the inner dimension holds contiguous ranks (same node).
    Its groups get ``timeout``, by default the world group's (the strategy's): torch would give a mesh's groups
    its 30-minute default, so a stuck peer would hang a collective on them that long.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if outer * inner != world:
        raise ValueError(
            f"a {names[0]} x {names[1]} mesh of {outer} x {inner} = {outer * inner} ranks does not match "
            f"world size {world}; choose sizes whose product is {world}"
        )
    timeout = timeout or group_timeout()
    override = _backend_options(device_type, timeout) if timeout is not None else None
    return init_device_mesh(device_type, (outer, inner), mesh_dim_names=names,
                            backend_override={names[0]: override, names[1]: override} if override else None)  # fmt: skip

"""Process groups and device meshes shared by every strategy.

The hierarchy used by layered SGD (ranks grouped into nodes, one leader per node) and the 2-D meshes used by
the hybrid, spatial and multigrid strategies are built here, once, on top of torch.distributed and
DeviceMesh.  Every function must be called by *all* ranks of the world group (torch.distributed requires
every rank to take part in creating every group).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_hpc._compat import groups_made_unsplit, process_group_timeout

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
    "MeshDim",
    "build_mesh",
    "mesh_ranks",
    "mesh_from_new_groups",
    "mesh_sizes",
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
    with groups_made_unsplit():
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
    device_type: str = "cpu",
) -> NodeGroups:
    """Create the node hierarchy: one group per node and one group of node leaders.

    ``layout`` lists the ranks of each node (default: contiguous blocks of ``group_size``); each group is led by
    its lowest rank.  ``intra_backend`` defaults to the world backend for ``device_type`` (NCCL on GPUs); the
    leader group defaults to gloo so the inter-node step can be driven from a CPU thread, as the layered-SGD
    paper's CPU communicators are.

    The groups are a ``("node", "local")`` DeviceMesh (:func:`build_mesh`) with one row per node, in any rank
    placement (hosts need not hold contiguous ranks): ``"local"`` is this rank's node group and ``"node"`` on a
    leader (the first column) the leader group.  The other columns' ``"node"`` groups join the i-th ranks of
    every node; layered SGD does not use them.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = check_layout(layout, world) if layout is not None else contiguous_layout(world, group_size)
    index = next(g for g, ranks in enumerate(groups) if rank in ranks)
    dims = [MeshDim("node", len(groups), backend=leader_backend),
            MeshDim("local", len(groups[0]), backend=intra_backend)]
    mesh = build_mesh(dims, device_type=device_type, timeout=timeout or default_timeout(), ranks=groups)
    leader = groups[index][0]
    return NodeGroups(
        group_size=len(groups[0]),
        num_groups=len(groups),
        group_index=index,
        leader_rank=leader,
        intra=mesh.get_group("local"),
        leaders=mesh.get_group("node") if rank == leader else None,
        members=tuple(groups[index]),
    )


def _world_backend(device_type: str) -> str | None:
    """The world's backend for ``device_type``: ``"gloo"`` from ``"cpu:gloo,cuda:nccl"``; a single backend
    (``"nccl"``) serves every device type."""
    spec = str(dist.get_backend())
    pairs = dict(p.split(":", 1) for p in spec.split(",")) if ":" in spec else {device_type: spec}
    return pairs.get(device_type)


def _backend_config(device_type: str, backend: str | None, timeout: datetime.timedelta) -> tuple[str | None, Any]:
    """(backend, options carrying ``timeout``) for one dimension of a DeviceMesh (its ``backend_override``).

    ``backend`` defaults to the world's for ``device_type``.  A backend whose options type we do not know
    (neither gloo nor NCCL) gets ``(name, None)``: its groups are still the mesh's own (never the world group),
    with torch's default timeout."""
    name = backend or _world_backend(device_type)
    if name == "gloo":
        # torch's stub lacks _Options (runtime class)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif name == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return name, None
    opts._timeout = timeout
    return name, opts


@dataclass(frozen=True)
class MeshDim:
    """One named dimension of a strategy's topology.

    ``size=-1`` takes the ranks the other dimensions leave (the data-parallel replicas, as torchtitan's
    ``ParallelDims(dp_shard=-1)``).  ``setting`` is what the user changes to change the size, written as it is
    named in errors (``"spatial_parts=2x2"``, ``"layer_parallel_size=4"``); ``what`` says what one group of this
    dimension is.  ``backend``: the dimension's groups' backend (default: the world's for the mesh's device).
    """

    name: str
    size: int = -1
    setting: str = ""
    what: str = ""
    backend: str | None = None


def _setting_name(dim: MeshDim) -> str:
    return (dim.setting or dim.name).split("=", 1)[0]


def mesh_sizes(world_size: int, dims: Sequence[MeshDim]) -> tuple[int, ...]:
    """The size of every dimension, ``-1`` resolved; raises ValueError naming the setting to change when
    the dimensions do not fit ``world_size`` ranks."""
    if not dims or len({d.name for d in dims}) != len(dims):
        raise ValueError(f"a mesh needs distinct dimension names, got {[d.name for d in dims]}")
    free = [d for d in dims if d.size == -1]
    if len(free) > 1:
        names = [d.name for d in free]
        raise ValueError(f"only one mesh dimension may take the remaining ranks (size -1), got {names}")
    for d in dims:
        if d.size != -1 and d.size <= 0:
            raise ValueError(f"{d.setting or f'{d.name}={d.size}'}: must be a positive integer")
    fixed = [d for d in dims if d.size != -1]
    product = math.prod(d.size for d in fixed)
    if free:
        if world_size % product != 0:
            shown = " x ".join(d.setting or f"{d.name}={d.size}" for d in fixed)
            what = "; ".join(d.what for d in fixed if d.what)
            change = " or ".join(_setting_name(d) for d in fixed)
            raise ValueError(
                f"world size {world_size} is not divisible by {shown}{f' ({what})' if what else ''}; "
                f"use a world size that is a multiple of {product}, or change {change}"
            )
        return tuple(world_size // product if d.size == -1 else d.size for d in dims)
    if product != world_size:
        raise ValueError(
            f"a {' x '.join(d.name for d in dims)} mesh of {' x '.join(str(d.size) for d in dims)} = {product} ranks "
            f"does not match world size {world_size}; choose sizes whose product is {world_size} "
            f"(change {' or '.join(_setting_name(d) for d in dims)})"
        )
    return tuple(d.size for d in dims)


def mesh_ranks(world_size: int, dims: Sequence[MeshDim], ranks: Any = None) -> Any:
    """The mesh tensor: global ranks laid out in the dimensions' shape.  Default: row-major blocks (the last
    dimension holds contiguous ranks, i.e. one node); ``ranks`` gives any other placement (e.g. one row per
    host, :func:`hosts_layout`), checked to hold every rank once in the dimensions' shape."""
    import torch

    sizes = mesh_sizes(world_size, dims)
    if ranks is None:
        return torch.arange(world_size, dtype=torch.int).reshape(sizes)
    mesh = torch.as_tensor(ranks, dtype=torch.int)
    if tuple(mesh.shape) != sizes or sorted(mesh.flatten().tolist()) != list(range(world_size)):
        raise ValueError(
            f"the rank layout {mesh.tolist()} does not place ranks 0..{world_size - 1} once each on a "
            f"{' x '.join(d.name for d in dims)} mesh of shape {sizes}"
        )
    return mesh


def build_mesh(
    dims: Sequence[MeshDim],
    *,
    device_type: str = "cpu",
    timeout: datetime.timedelta | None = None,
    ranks: Any = None,
):
    """The one builder of a strategy's topology: validates ``dims`` against the world (:func:`mesh_sizes`) and
    returns a DeviceMesh with those dimension names, whose groups ``mesh.get_group(name)`` are the strategy's
    named process groups.  Collective: every rank of the world calls it with the same arguments.

    ``ranks`` places the ranks (default: row-major blocks, see :func:`mesh_ranks`); non-contiguous placements
    are fine.  Every dimension's groups get ``timeout``, by default the world group's (the strategy's): torch
    would give them its 30-minute default, so a stuck peer would hang a collective on them that long.  They are
    always the mesh's own groups, even a dimension spanning the whole world (torch would hand out the world
    group there, and collectives on it would interleave with DDP's).
    """
    from torch.distributed.device_mesh import DeviceMesh

    mesh = mesh_ranks(dist.get_world_size(), dims, ranks)
    timeout = timeout or group_timeout() or default_timeout()
    override = tuple(_backend_config(device_type, d.backend, timeout) for d in dims)
    names = tuple(d.name for d in dims)
    # A world group bound to a device (Lightning binds it on CUDA) makes DeviceMesh split its groups off the world
    # group, which only NCCL can do: torch's split_group on a gloo world ends in "No device(s) specified".
    if getattr(dist.group.WORLD, "bound_device_id", None) is not None and any(b != "nccl" for b, _ in override):
        return mesh_from_new_groups(device_type, mesh, names, override)
    return DeviceMesh(device_type, mesh, mesh_dim_names=names, backend_override=override)


def mesh_from_new_groups(device_type: str, mesh: Any, names: tuple[str, ...],
                         backends: Sequence[tuple[str | None, Any]]):
    """The DeviceMesh of :func:`build_mesh` from groups made one by one with ``new_group`` (what DeviceMesh does
    when it cannot split the world group): for every dimension, every row of ``mesh`` along it, in the same order
    on every rank; ``backends`` gives each dimension's (backend, options).  Collective."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    with groups_made_unsplit():
        for dim, (backend, options) in enumerate(backends):
            rows = mesh.swapdims(-1, dim).reshape(-1, mesh.size(dim))
            own = None
            for row in rows.tolist():
                group = dist.new_group(ranks=row, backend=backend, pg_options=options,
                                       timeout=getattr(options, "_timeout", None))
                if rank in row:
                    own = group
            assert own is not None  # every rank is in one row of every dimension (mesh_ranks)
            mine.append(own)
    return DeviceMesh.from_group(mine, device_type, mesh, mesh_dim_names=names)


def mesh_2d(
    outer: int, inner: int, names: tuple[str, str], device_type: str = "cpu", timeout: datetime.timedelta | None = None
):
    """A 2-D DeviceMesh of shape ``(outer, inner)`` (:func:`build_mesh`); ``outer * inner`` must equal the
    world size.  Rank r sits at ``(r // inner, r % inner)``: the inner dimension holds contiguous ranks."""
    return build_mesh([MeshDim(names[0], outer), MeshDim(names[1], inner)], device_type=device_type, timeout=timeout)

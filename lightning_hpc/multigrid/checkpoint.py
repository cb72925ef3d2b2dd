"""Full optimizer state of a model with a layer-sharded trunk, in the serial model's layout.

Rank r of a layer chain builds its optimizer from its own parameters: the replicated ones (opening and closing
layers) and the parameters of its own residual steps (:class:`~lightning_hpc.multigrid.sharded.LayerShardedTrunk`).
Its ``optimizer.state_dict()`` numbers them 0, 1, ... in its own order, so the per-rank dicts differ from each
other and from what one process training the serial model would write.

:func:`full_optimizer_state` writes the dict one process would write: ``state`` keyed by the serial parameter
index and ``param_groups`` listing the serial indices.  The serial order of a parameter group is the rank's own
order with the trunk parameters of every rank in place: between two consecutive replicated parameters of the
group, the trunk parameters of rank 0, then those of rank 1, ... (for an optimizer built from
``model.parameters()``, or any filter of it, that is the serial model's order, since rank r holds the r-th block
of steps).  Only the trunk parameters' state travels (the replicated parameters' state is the same on every
rank), to one rank, in flat per-dtype buckets, the transport every full-state checkpoint uses
(:func:`~lightning_hpc.distributed.state.gather_keyed_tensors`; the trunk tensors are its *owned* keys).

:func:`local_optimizer_state` is the inverse: each rank takes, from a full (or serial) optimizer state dict, the
entries of the parameters it holds, renumbered in its own order, for any number of layer ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.state import gather_keyed_tensors
from lightning_hpc.distributed.whole_flat import keeps_global_state
from lightning_hpc.multigrid.sharded import LayerShardedTrunk

__all__ = [
    "full_optimizer_state",
    "local_optimizer_state",
    "optimizer_parameter_names",
    "serial_layout",
    "serial_optimizer",
]

#: (name, sharded) of each parameter of each param group, in the optimizer's order
Names = list[list[tuple[str, bool]]]


def _sharded_trunks(module: nn.Module) -> list[LayerShardedTrunk]:
    return [m for m in module.modules() if isinstance(m, LayerShardedTrunk) and m.chain.size > 1]


def layer_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The layer group of the model's sharded trunks (``None``: nothing is sharded)."""
    trunks = _sharded_trunks(module)
    if not trunks:
        return None
    ranks = {tuple(t.chain.ranks) for t in trunks}
    if len(ranks) > 1:
        raise ValueError(
            f"the model's layer-sharded trunks are split over different groups {sorted(ranks)}; one group is supported"
        )
    return trunks[0].group


def optimizer_parameter_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> Names:
    """The name in ``module`` (= the serial model's name) of every parameter of every param group, and whether
    it belongs to a layer-sharded trunk.  A parameter outside ``module`` is named by its place among the
    group's unnamed ones (it must be replicated)."""
    names = {id(p): n for n, p in module.named_parameters()}
    sharded = {id(p) for t in _sharded_trunks(module) for p in t.parameters()}
    out: Names = []
    for g, group in enumerate(optimizer.param_groups):
        unnamed = 0
        entries = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                name, unnamed = f"<unnamed parameter {unnamed} of param group {g}>", unnamed + 1
            entries.append((name, id(p) in sharded))
        out.append(entries)
    return out


def serial_layout(per_rank: Sequence[Names]) -> list[list[str]]:
    """The serial order of each param group's parameters, from every layer rank's (name, sharded) lists.

    The replicated parameters must be the same, in the same order, on every rank; between two of them (and
    before the first, after the last) come the sharded parameters of rank 0, then of rank 1, ..."""
    groups = {len(names) for names in per_rank}
    if len(groups) != 1:
        raise ValueError(f"the layer ranks' optimizers have different numbers of param groups ({sorted(groups)})")
    layout: list[list[str]] = []
    for g in range(groups.pop()):
        replicated = [[n for n, s in names[g] if not s] for names in per_rank]
        if any(r != replicated[0] for r in replicated):
            raise ValueError(
                f"param group {g} holds different replicated (not layer-sharded) parameters on the layer ranks; the "
                "serial optimizer layout needs the same ones in the same order on every rank"
            )
        gaps: list[list[list[str]]] = []  # gaps[rank][k]: sharded names after the k-th replicated one
        for names in per_rank:
            rank_gaps: list[list[str]] = [[]]
            for name, sharded in names[g]:
                if sharded:
                    rank_gaps[-1].append(name)
                else:
                    rank_gaps.append([])
            gaps.append(rank_gaps)
        serial: list[str] = []
        for k in range(len(replicated[0]) + 1):
            if k:
                serial.append(replicated[0][k - 1])
            for rank_gaps in gaps:
                serial.extend(rank_gaps[k])
        layout.append(serial)
    return layout


def _layouts(
    optimizer: torch.optim.Optimizer, module: nn.Module, group: dist.ProcessGroup
) -> tuple[Names, list[list[str]]]:
    """This rank's names and the serial layout (from every rank of ``group``)."""
    mine = optimizer_parameter_names(optimizer, module)
    per_rank: list[Names | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, mine, group=group)
    return mine, serial_layout([n for n in per_rank if n is not None])


def _serial_indices(layout: list[list[str]]) -> dict[str, int]:
    index: dict[str, int] = {}
    for names in layout:
        for name in names:
            if name in index:
                raise ValueError(f"parameter {name} is in two param groups of the optimizer")
            index[name] = len(index)
    return index


def full_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, dst: int | None = 0) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the serial model's optimizer would write it, on global rank ``dst``
    (collective over the layer group of ``module``'s sharded trunks, which must contain ``dst``); the other
    ranks get their own ``optimizer.state_dict()`` back (``dst=None``: every rank gets the full one).  Without a
    sharded trunk it is ``optimizer.state_dict()``."""
    return _full_optimizer_state(optimizer, module, dst)[0]


def serial_optimizer(
    optimizer: torch.optim.Optimizer, module: nn.Module
) -> tuple[dict[str, Any], list[list[str]], Names]:
    """What rebinding ``optimizer`` to the whole model needs (collective): the serial model's optimizer state on
    every rank (:func:`full_optimizer_state` with ``dst=None``), the serial names of each param group's
    parameters, and this rank's :func:`optimizer_parameter_names` (names in ``module``, or ``<unnamed ...>``)."""
    return _full_optimizer_state(optimizer, module, None)


def _full_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, dst: int | None
) -> tuple[dict[str, Any], list[list[str]], Names]:
    local = optimizer.state_dict()
    group = layer_group(module)
    mine = optimizer_parameter_names(optimizer, module)
    if group is None:
        return local, [[name for name, _ in names] for names in mine], mine
    mine, layout = _layouts(optimizer, module, group)
    me = dist.get_rank()
    # an optimizer whose one state is the whole model's (LBFGS's flat vectors, equal on every rank) keeps it under
    # its first parameter: under the serial model's first one, as one process writes it, whichever rank's
    # parameter this rank's first one is
    global_state = keeps_global_state(optimizer)
    # this rank's sharded parameters' state: tensors travel as flat buffers on the parameters' device, the rest
    # (and where each tensor lives: Adam keeps "step" on the host) as a small object
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    tensors: dict[str, torch.Tensor] = {}
    entries: list[tuple[str, str, str, bool]] = []  # (name, state key, key in tensors or values, on host)
    values: dict[str, Any] = {}
    for i, (name, sharded) in enumerate(n for names in mine for n in names):
        if not sharded or i not in local["state"] or global_state:
            continue
        for key, value in local["state"][i].items():
            if torch.is_tensor(value):
                tkey = f"{me}:{len(tensors)}"
                tensors[tkey] = value.to(device)
                entries.append((name, key, tkey, value.device.type == "cpu"))
            else:
                vkey = f"{me}:v{len(values)}"
                values[vkey] = value
                entries.append((name, key, vkey, False))
    gathered = gather_keyed_tensors(tensors, group, dst, device=device)
    metas: list[Any] = [None] * dist.get_world_size(group) if dst is None or me == dst else []
    if dst is None:
        dist.all_gather_object(metas, (entries, values), group=group)
    else:
        dist.gather_object((entries, values), metas if me == dst else None, dst=dst, group=group)
        if me != dst:
            return local, layout, mine
    serial = _serial_indices(layout)
    state: dict[int, dict[str, Any]] = {}
    for i, (name, sharded) in enumerate(n for names in mine for n in names):  # replicated: this rank's state
        if not sharded and i in local["state"] and not global_state:
            state[serial[name]] = dict(local["state"][i])
    if global_state and 0 in local["state"]:
        state[0] = dict(local["state"][0])
    for meta in metas:
        rank_entries, rank_values = meta
        for name, key, vkey, host in rank_entries:
            value = gathered[vkey] if vkey in gathered else rank_values[vkey]
            if torch.is_tensor(value) and host:
                value = value.cpu()
            state.setdefault(serial[name], {})[key] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [serial[n] for n in names]}
        for g, names in zip(local["param_groups"], layout)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}, layout, mine


def local_optimizer_state(full: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The entries of a full (serial-layout) optimizer state dict for the parameters this rank's ``optimizer``
    holds, numbered as ``optimizer.state_dict()`` numbers them (collective over the layer group of ``module``'s
    sharded trunks; without one, ``full`` is returned unchanged)."""
    group = layer_group(module)
    if group is None:
        return full
    mine, layout = _layouts(optimizer, module, group)
    saved_groups = full["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(names) for names in layout]:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of {sizes} parameters, the serial layout of this model's "
            f"optimizer has {[len(names) for names in layout]}: the checkpoint was written for another model or "
            "optimizer configuration"
        )
    saved_id = {name: saved_groups[g]["params"][k] for g, names in enumerate(layout) for k, name in enumerate(names)}
    state: dict[int, Any] = {}
    groups = []
    i = 0
    global_state = keeps_global_state(optimizer)
    for g, names in enumerate(mine):
        params = []
        for name, _ in names:
            entry = full["state"].get(saved_id[name])
            if entry is not None and not global_state:
                state[i] = dict(entry)
            params.append(i)
            i += 1
        groups.append({**{k: v for k, v in saved_groups[g].items() if k != "params"}, "params": params})
    first = saved_groups[0]["params"][0] if saved_groups and saved_groups[0]["params"] else None
    if global_state and first in full["state"]:  # the whole model's state, under the first parameter (every rank)
        state[0] = dict(full["state"][first])
    return {"state": state, "param_groups": groups}

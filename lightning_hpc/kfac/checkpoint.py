"""Checkpoints of a :class:`~lightning_hpc.kfac.preconditioner.KFACPreconditioner`: counters, running factors and
every layer's decompositions, so a resumed run continues bitwise.

With a gradient-worker fraction below 1 (KAISA's MEM-OPT / HYBRID-OPT, multi-rank ``layer_wise`` by default) each
rank holds only the decompositions of its worker group's layers: :func:`state_dict` then gathers them (a
collective), and :func:`load_state_dict` keeps each rank's own. A checkpoint that kept each group of a grouped
convolution as a layer of its own (``<layer>#g<i>``) is stacked into the layer's ``(groups, ...)`` entries
(:func:`stack_group_entries`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_hpc.kfac import worker_groups
from lightning_hpc.kfac.layers import LayerHandler

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["gather_decompositions", "load_state_dict", "stack_group_entries", "state_dict"]


def _sharded(pre: KFACPreconditioner) -> bool:
    """Each rank holds only the decompositions of the layers of its gradient-worker group."""
    return pre.grid.broadcasts_gradients and pre.comm.world_size > 1


def gather_decompositions(pre: KFACPreconditioner) -> dict[str, dict[str, torch.Tensor]]:
    """Every layer's decompositions on every rank (collective): when they are sharded the owners broadcast
    theirs (one buffer per owner, as the decomposition step shares them), so a checkpoint written by rank 0 lets
    every rank resume with the decompositions it had, instead of recomputing them from newer factors."""
    owned = {h.name for i, h in enumerate(pre.handlers) if pre._is_worker(i) and h.decompositions}
    owners = pre.assignment()
    rank = pre.comm.rank
    # counted once per layer: by the rank that decomposes its first factor (a member of its worker group)
    present = torch.tensor(
        [1.0 if h.name in owned and owners[(i, next(iter(h.factor_forms())))] == rank else 0.0
         for i, h in enumerate(pre.handlers)],
        device=pre.comm_device(),
    )
    pre.comm.allreduce(present, op="sum").wait()  # which layers have a decomposition on their owner
    work = [
        (owners[(i, kind)], h, kind)
        for i, h in enumerate(pre.handlers)
        if present[i].item() > 0
        for kind in h.factor_forms()
    ]
    mine = {(h.name, kind): h.state.decomposition_of(kind, pre.method) for owner, h, kind in work if owner == rank}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (name, kind), res in worker_groups.share_decompositions(pre, work, mine).items():
        for k, v in res.items():
            out.setdefault(name, {})[f"{k}_{kind}"] = v
    return out


def state_dict(pre: KFACPreconditioner) -> dict[str, Any]:
    """See :meth:`KFACPreconditioner.state_dict`."""
    decompositions = gather_decompositions(pre) if _sharded(pre) else pre.decompositions
    extra = {} if pre.subsample_generator is None else {"subsample_rng": pre.subsample_generator.get_state()}
    return {
        **extra,
        "steps": pre.steps,
        "epoch": pre.epoch,
        "compute_method": pre.compute_method,
        "factors": {n: {k: v.detach().clone() for k, v in f.items()} for n, f in pre.factors.items()},
        "decompositions": {n: {k: v.detach().clone() for k, v in d.items()} for n, d in decompositions.items()},
    }


def load_state_dict(pre: KFACPreconditioner, state: dict[str, Any]) -> None:
    """See :meth:`KFACPreconditioner.load_state_dict`."""
    state = stack_group_entries(pre.handlers, state)
    names = {h.name for h in pre.handlers}
    unknown = sorted(set(state.get("factors", {})) - names)
    if unknown:
        raise ValueError(f"K-FAC checkpoint has factors for layers this model does not register: {unknown[:5]}")
    pre.steps = int(state["steps"])
    pre.epoch = int(state.get("epoch", 0))
    if pre.subsample_generator is not None and "subsample_rng" in state:
        pre.subsample_generator.set_state(state["subsample_rng"])
    same_method = state.get("compute_method", pre.compute_method) == pre.compute_method
    saved = state.get("decompositions", {}) if same_method else {}
    for i, h in enumerate(pre.handlers):
        # with a gradient-worker fraction below 1 a rank keeps only its worker group's decompositions
        keep = h.name in saved and (not _sharded(pre) or pre._is_worker(i))
        h.state.load(state["factors"].get(h.name, {}), saved[h.name] if keep else {}, h.weight.device,
                     pre.factor_dtype, pre.inverse_dtype)


def stack_group_entries(handlers: Sequence[LayerHandler], state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the entries of a checkpoint that kept each group of a grouped convolution as a layer of
    its own (``<layer>#g<i>``, one block each) stacked into the layer's ``(groups, ...)`` factors and
    decompositions: the same blocks in the layout :class:`~.layers.GroupConvHandler` keeps. A layer with only
    some of its groups' entries, or with entries of both layouts, is refused."""
    sections = {key: dict(state.get(key, {})) for key in ("factors", "decompositions")}
    for h in handlers:
        if h.groups == 1:
            continue
        names = [f"{h.name}#g{i}" for i in range(h.groups)]
        for key, section in sections.items():
            found = [n for n in names if n in section]
            if not found:
                continue
            parts = [section.pop(n, None) for n in names]
            keys = {tuple(sorted(p)) for p in parts if p is not None}
            if len(found) != len(names) or h.name in section or len(keys) != 1:
                raise ValueError(
                    f"K-FAC checkpoint: the {key} of grouped layer {h.name!r} are neither one entry nor one "
                    f"'{h.name}#g<i>' entry with the same tensors for each of its {h.groups} groups (found "
                    f"{found[:5]}{' and the whole layer' if h.name in section else ''}); it was written for "
                    "another model"
                )
            section[h.name] = {k: torch.stack([p[k] for p in parts if p is not None]) for k in next(iter(keys))}
    return {**state, **sections}

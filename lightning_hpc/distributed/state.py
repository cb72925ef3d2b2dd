"""Gathering state that is partitioned by key over the ranks of a group (e.g. the residual steps of a
layer-parallel trunk: each rank holds the tensors of its own steps only).

Checkpoints need the full state on the rank that writes them; the tensors travel as one flat buffer per
(owner, dtype), so the number of messages is the number of ranks, not the number of tensors.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["gather_keyed_tensors"]


def gather_keyed_tensors(
    local: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None, dst: int | None = None, device: torch.device | None = None
) -> OrderedDict[str, torch.Tensor]:
    """Union of every rank's ``local`` tensors (disjoint keys), ordered by group rank, then by local order.

    Collective over ``group`` (``None``: this process alone, the dict is returned as is).  ``dst`` (a global
    rank of the group) receives the full dict and the other ranks get only their own tensors back (saves the
    memory of a full copy where only one rank writes the checkpoint); ``dst=None`` gives it to every rank.
    ``device``: where the buffers travel and the received tensors are put (default: the device of this rank's
    first tensor, or the host); every local tensor must be on it.
    """
    if group is None or dist.get_world_size(group) == 1:
        return OrderedDict(local)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    if dst is not None and dst not in ranks:
        raise ValueError(f"dst={dst} is not a rank of the group {ranks}")
    tensors = OrderedDict((k, v.detach()) for k, v in local.items())
    if device is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    # shapes/dtypes first (small objects), so that non-owners can allocate the receive buffers
    metas: list[list[tuple[str, tuple[int, ...], torch.dtype]] | None] = [None] * len(ranks)
    dist.all_gather_object(metas, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], group=group)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for owner, meta in zip(ranks, metas):
        assert meta is not None
        wanted = dst is None or me == dst or me == owner
        if not wanted:
            continue  # a point-to-point transfer between two other ranks: nothing to allocate or receive here
        for dtype in dict.fromkeys(m[2] for m in meta):  # one buffer per dtype, in first-seen order
            items = [m for m in meta if m[2] == dtype]
            if me == owner and dst == owner:  # the destination's own tensors: nothing travels
                out.update((key, tensors[key]) for key, _, _ in items)
                continue
            if me == owner:
                flat = torch.cat([tensors[k].reshape(-1) for k, _, _ in items])
            else:
                flat = torch.empty(sum(math.prod(s) for _, s, _ in items), dtype=dtype, device=device)
            if dst is None:
                dist.broadcast(flat, owner, group=group)
            elif owner != dst:
                if me == owner:
                    dist.send(flat, dst, group=group)
                elif me == dst:
                    dist.recv(flat, owner, group=group)
            offset = 0
            for key, shape, _ in items:
                n = math.prod(shape)
                out[key] = flat[offset : offset + n].view(shape).clone() if me != owner else tensors[key]
                offset += n
    return out


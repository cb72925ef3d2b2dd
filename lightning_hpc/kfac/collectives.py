"""The two collective patterns of distributed K-FAC (SC20 Algorithm 1), over a
:class:`~lightning_hpc.distributed.comm.Communicator`:

* :func:`allreduce_mean` -- step 1: the batch factors averaged across ranks, fused into size-capped buckets,
  all buckets in flight at once (as bucketed gradient all-reduce does);
* :func:`broadcast_by_owner` -- step 2 (and K-FAC-lw's gradients): each owning rank broadcasts one flat
  buffer of everything it computed, all owners' broadcasts in flight at once (the paper's allgather).

Both only move tensors; which rank owns what is the placement's business (:mod:`.placement`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from lightning_hpc.distributed.comm import Communicator

__all__ = ["allreduce_mean", "allreduce_mean_symmetric", "broadcast_by_owner", "buckets"]


def buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Consecutive runs of ``tensors`` (one dtype and device each, at most ``cap_bytes`` unless a single tensor
    is larger) with their flat concatenation."""
    bucket: list[torch.Tensor] = []
    size = 0
    out = []
    for t in tensors:
        if bucket and (
            size + t.numel() * t.element_size() > cap_bytes
            or t.dtype != bucket[0].dtype
            or t.device != bucket[0].device
        ):
            out.append((bucket, torch.cat([x.reshape(-1) for x in bucket])))
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        out.append((bucket, torch.cat([x.reshape(-1) for x in bucket])))
    return out


def allreduce_mean(comm: Communicator, tensors: Sequence[torch.Tensor], cap_bytes: int) -> None:
    """Average ``tensors`` across ranks in place: fused into buckets, all in flight at once."""
    for bucket, flat, handle in [
        (b, f, comm.allreduce(f, op="mean", async_op=True)) for b, f in buckets(tensors, cap_bytes)
    ]:
        handle.wait()
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_by_owner(
    comm: Communicator,
    items: dict[int, list[tuple[Hashable, dict[str, tuple[int, ...]]]]],
    local: dict[Hashable, dict[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    group: Any = None,
) -> dict[Hashable, dict[str, torch.Tensor]]:
    """Every rank of ``group`` (None: the world) gets every owner's tensors: ``items[owner]`` lists
    ``(key, {name: shape})`` in a fixed order (the same on every rank of the group; owners are global ranks in
    the group); the owner's own values are ``local[key][name]``. One flat broadcast per owner, all in flight at
    once; returns ``{key: {name: tensor}}`` (fresh tensors) for all items."""
    pending = []
    for owner, entries in sorted(items.items()):
        total = sum(math.prod(s) for _, shapes in entries for s in shapes.values())
        if owner == comm.rank:
            flat = torch.cat(
                [local[key][k].reshape(-1).to(device=device, dtype=dtype) for key, shapes in entries for k in shapes]
            )
        else:
            flat = torch.empty(total, dtype=dtype, device=device)
        pending.append((entries, flat, comm.broadcast(flat, src=owner, group=group, async_op=True)))
    out: dict[Hashable, dict[str, torch.Tensor]] = {}
    for entries, flat, handle in pending:
        handle.wait()
        offset = 0
        for key, shapes in entries:
            res = {}
            for k, shape in shapes.items():
                n = math.prod(shape)
                res[k] = flat[offset : offset + n].view(shape).clone()
                offset += n
            out[key] = res
    return out


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    iu = torch.triu_indices(n, n, device=device)
    return iu[0], iu[1]


def allreduce_mean_symmetric(comm: Communicator, matrices: Sequence[torch.Tensor], cap_bytes: int) -> None:
    """:func:`allreduce_mean` of symmetric matrices that sends only their upper triangles (``n (n + 1) / 2`` of
    the ``n^2`` elements, about half the bytes) and mirrors the result. Bitwise equal to reducing the full
    matrices when the inputs are exactly symmetric (the factors are: :func:`~.linalg.sym_gram` mirrors its
    triangle), since element ``(i, j)`` and ``(j, i)`` are the same sums in the same order."""
    packed = []
    index = []
    for m in matrices:
        rows, cols = _triu(m.shape[0], m.device)
        packed.append(m[rows, cols])
        index.append((rows, cols))
    allreduce_mean(comm, packed, cap_bytes)
    for m, v, (rows, cols) in zip(matrices, packed, index):
        m[rows, cols] = v
        m[cols, rows] = v

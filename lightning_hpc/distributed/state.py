"""Full-state checkpoints of partitioned models: the one gather / re-shard mechanism every strategy uses.

A strategy's checkpoint is the serial model's (serial keys, full tensors, gathered to one rank) and loads onto
any world size the strategy supports.  What a rank holds is described by keyed tensors of two kinds:

- **owned** keys: the whole tensor lives on one rank of the group (a layer-parallel trunk's residual steps,
  :mod:`lightning_hpc.multigrid.checkpoint`);
- **split** keys (``split_dims={key: dim}``): every rank holds a slice, and the full tensor is the ranks' slices
  concatenated along ``dim`` in group-rank order (a row- or column-sharded linear layer and its optimizer
  state, :mod:`lightning_hpc.hybrid_fc.checkpoint`).

:func:`gather_keyed_tensors` moves both the same way: the tensors of each rank travel in flat per-dtype buckets
of at most ``bucket_bytes`` (a larger tensor travels alone), one bucket at a time, on the device the tensors live
on (any backend: NCCL, gloo, ...), each received piece moved at once to ``out_device`` (e.g. host memory).  So
a receiving rank holds on the device, besides its own tensors, one bucket; the full state accumulates on
``out_device``; a sending rank holds its own tensors plus one bucket.  Re-sharding on load is the inverse:
:func:`take_slice` cuts a rank's slice of a full split tensor (the same block rule as saving); which keys and
slices a rank takes is the technique's knowledge, kept in its folder.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_BUCKET_BYTES", "gather_keyed_tensors", "take_slice"]

#: bytes of one flat message; a single larger tensor travels alone
DEFAULT_BUCKET_BYTES = 32 * 2**20

#: (key, shape, dtype) of one tensor a rank contributes
_Meta = tuple[str, tuple[int, ...], torch.dtype]


def _buckets(meta: Sequence[_Meta], bucket_bytes: int) -> Iterator[list[_Meta]]:
    """``meta`` in per-dtype runs (dtypes in first-seen order) cut into buckets of at most ``bucket_bytes``."""
    for dtype in dict.fromkeys(m[2] for m in meta):
        bucket: list[_Meta] = []
        size = 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        for m in meta:
            if m[2] != dtype:
                continue
            nbytes = math.prod(m[1]) * itemsize
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(m)
            size += nbytes
        if bucket:
            yield bucket


def gather_keyed_tensors(
    local: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    dst: int | None = None,
    device: torch.device | None = None,
    *,
    split_dims: Mapping[str, int] | None = None,
    out_device: torch.device | str | None = None,
    bucket_bytes: int | None = None,
) -> OrderedDict[str, torch.Tensor]:
    """The full state from every rank's ``local`` tensors: owned keys as they are, split keys (``split_dims``,
    held by every rank) concatenated along their dimension in group-rank order.  Ordered by group rank, then by
    local order (a split key where rank 0 has it).

    Collective over ``group`` (``None``: this process alone, the dict is returned as is).  ``dst`` (a global
    rank of the group) receives the full dict and the other ranks get only their own tensors back (saves the
    memory of a full copy where only one rank writes the checkpoint); ``dst=None`` gives it to every rank.
    ``device``: where the buckets travel (default: the device of this rank's first tensor, or the host); local
    tensors kept elsewhere (a weight-averaging copy on the host beside a model on a GPU: NCCL moves device tensors
    only) travel through it.  ``out_device``: where received tensors are put (default: where this rank's tensors
    are kept, or ``device`` when it has none); this rank's own owned tensors are returned as they are.
    ``bucket_bytes``: the largest flat message (default :data:`DEFAULT_BUCKET_BYTES`).
    """
    split = dict(split_dims or {})
    if group is None or dist.get_world_size(group) == 1:
        return OrderedDict(local)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    if dst is not None and dst not in ranks:
        raise ValueError(f"dst={dst} is not a rank of the group {ranks}")
    tensors = OrderedDict((k, v.detach()) for k, v in local.items())
    home = next(iter(tensors.values())).device if tensors else None
    device = torch.device(device) if device is not None else home or torch.device("cpu")
    target = torch.device(out_device) if out_device is not None else home or device
    # what this rank sends, on the device the collectives run on (the tensors themselves where they are there)
    sent = OrderedDict((k, v.to(device)) for k, v in tensors.items())
    # shapes/dtypes first (small objects), so that receivers can allocate the buckets
    metas: list[list[_Meta] | None] = [None] * len(ranks)
    dist.all_gather_object(metas, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], group=group)
    missing = [k for k in split for meta in metas if meta is not None and k not in {m[0] for m in meta}]
    if missing:
        raise ValueError(f"split keys must be held by every rank of the group; missing on some: {sorted(set(missing))}")
    receives = dst is None or me == dst
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    pieces: dict[str, list[torch.Tensor]] = {}
    for owner, meta in zip(ranks, metas):
        assert meta is not None
        if not receives and me != owner:
            continue  # a transfer between two other ranks: nothing to allocate or receive here
        for bucket in _buckets(meta, DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes):
            if me == owner and (dst is None or dst == owner):
                received = {key: tensors[key] for key, _, _ in bucket}  # the receiver's own tensors
                if dst is None:
                    dist.broadcast(torch.cat([sent[key].reshape(-1) for key in received]), owner, group=group)
            else:
                if me == owner:
                    flat = torch.cat([sent[key].reshape(-1) for key, _, _ in bucket])
                else:
                    flat = torch.empty(sum(math.prod(s) for _, s, _ in bucket), dtype=bucket[0][2], device=device)
                if dst is None:
                    dist.broadcast(flat, owner, group=group)
                elif me == owner:
                    dist.send(flat, dst, group=group)
                else:
                    dist.recv(flat, owner, group=group)
                if me == owner:
                    continue  # a sender keeps its own tensors (below)
                offset, received = 0, {}
                for key, shape, _ in bucket:
                    n = math.prod(shape)
                    received[key] = flat[offset : offset + n].view(shape).to(target, copy=True)
                    offset += n
                del flat
            for key, value in received.items():
                if key in split:
                    pieces.setdefault(key, []).append(value)
                else:
                    out[key] = value
    if not receives:
        return OrderedDict(tensors)
    for key in split:
        parts = pieces.pop(key)
        out[key] = torch.cat([p.to(target) for p in parts], split[key])
        del parts
    order = dict.fromkeys(key for meta in metas if meta is not None for key, _, _ in meta)
    return OrderedDict((key, out[key]) for key in order)


def take_slice(full: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Block ``index`` of ``full`` split along ``dim`` into blocks of ``sizes`` (the inverse of gathering a
    split key): a copy, so the full tensor can be freed."""
    if full.shape[dim] != sum(sizes):
        raise ValueError(
            f"a tensor of {full.shape[dim]} entries along dimension {dim} cannot be split into {list(sizes)}"
        )
    start = sum(sizes[:index])
    return full.narrow(dim, start, sizes[index]).clone()

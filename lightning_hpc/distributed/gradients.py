"""The one flat gradient reduction every technique uses.

Gradients are bucketed by (dtype, device), flattened into one contiguous buffer per bucket, reduced with a
single ``all_reduce`` and copied back with each tensor's own scale (as DistributedDataParallel's buckets do),
so the number of collectives is the number of buckets, not of parameters.  A caller says per tensor what to
multiply the sum by: ``1/k`` averages over ``k`` ranks, ``1`` keeps the sum of partial gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_hpc._compat import flatten_dense_tensors, unflatten_dense_tensors

__all__ = ["allreduce_flat"]


@torch.no_grad()
def allreduce_flat(
    tensors: Sequence[torch.Tensor],
    scales: Sequence[float] | float = 1.0,
    group: dist.ProcessGroup | None = None,
    on_bucket: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """In place: ``t <- scale * sum over the group's ranks of t`` for every tensor of ``tensors``.

    ``scales`` is one number for all or one per tensor; ``on_bucket`` sees each flat buffer before it is sent
    (byte counting).  A no-op outside a process group or on a group of one.
    """
    if not tensors or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    per_tensor = [float(scales)] * len(tensors) if isinstance(scales, (int, float)) else [float(s) for s in scales]
    if len(per_tensor) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(per_tensor)} scales")
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for k, t in enumerate(tensors):
        buckets.setdefault((t.dtype, t.device), []).append(k)
    for idx in buckets.values():
        members = [tensors[k] for k in idx]
        flat = flatten_dense_tensors(members)  # one copy; the scaling is done on the way back
        if on_bucket is not None:
            on_bucket(flat)
        dist.all_reduce(flat, group=group)
        for k, synced in zip(idx, unflatten_dense_tensors(flat, members)):
            if per_tensor[k] == 1.0:
                tensors[k].copy_(synced)
            else:
                torch.mul(synced, per_tensor[k], out=tensors[k])

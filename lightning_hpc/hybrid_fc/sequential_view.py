"""The user's ``nn.Sequential`` as user code reads it while its head is split.

``hybrid_fc`` runs a head that is the trailing children of an ``nn.Sequential`` (or the whole of one) as a
:class:`~lightning_hpc.hybrid_fc.head.HybridHead`, registered in that container's place for the stage.  Its
children keep their names and order (trunk children, then the head's element-wise modules and shards), so
``self.model[-1]``, ``len(self.model)``, iteration and slices of trunk children read as on one process; a head
layer read this way is this rank's shard, whose parameters are blocks of the whole layer's
(:class:`~lightning_hpc.distributed.partitioned.BlockTensor`): a norm of them, a penalty or
``clip_grad_norm_`` over them sees the whole layer, as on one process.  Calling a shard on its own is refused by
:class:`~lightning_hpc.hybrid_fc.sharded_linear.ShardedLinear` (it holds a part of the layer)."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["IndexedLikeSequential"]


class IndexedLikeSequential:
    """Indexing, ``len`` and iteration of an ``nn.Module`` by its children in registration order, as
    ``nn.Sequential`` does (a slice is an ``nn.Sequential`` of those children)."""

    _modules: dict[str, nn.Module | None]

    def __getitem__(self, idx: Any) -> Any:
        children = list(self._modules.items())
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict((name, m) for name, m in children[idx] if m is not None))
        index = operator.index(idx)
        if not -len(children) <= index < len(children):
            raise IndexError(f"index {index} is out of range")
        return children[index][1]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module | None]:
        return iter(self._modules.values())

"""Keys for the objects a custom operator refers to (:mod:`~lightning_hpc.spatial.kernels.graph_ops`): an
operator's arguments are tensors and numbers, so a plan or a process group is passed as the key :func:`key_of`
gives it and resolved by :func:`lookup`, as torch resolves process groups by name.  The keys live for the process
(the objects are kept: a plan is small and a step uses a fixed set), so a key is never reused for another object.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["key_of", "lookup"]

_keys: dict[int, int] = {}  # id(object) -> key
_objects: dict[int, Any] = {}  # key -> object
_counter = itertools.count(1)


def key_of(obj: Any) -> int:
    """The operator-argument key of a plan or a process group (one per object)."""
    k = _keys.get(id(obj))
    if k is None:
        k = _keys[id(obj)] = next(_counter)
        _objects[k] = obj
    return k


def lookup(key: int) -> Any:
    """The object :func:`key_of` gave ``key``."""
    return _objects[key]

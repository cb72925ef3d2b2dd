"""The dispatcher's per-process state: the active module names for messages, the warnings already given, the gather
counters, a temporary override of the grids' policy for ops without a tiled form (:func:`on_unsupported`), and the
error every refusal raises.  The strategy's settings (overlap, ``on_unsupported``) and the record of parameters met
on tiles belong to the grid the split tensors carry (:attr:`SpatialGrid.policy`, :attr:`SpatialGrid.tile_params`),
not to this state.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from lightning_hpc.spatial.policy import ON_UNSUPPORTED


class SpatialDispatchError(RuntimeError):
    """An op on a spatially split activation that cannot be computed exactly (or gathering was disabled)."""


class DispatchState:
    """Per-process state: the active module names (for messages), the warnings already given and a temporary
    override of what happens to ops without a tiled form (None: each grid's own policy)."""

    def __init__(self) -> None:
        self.on_unsupported: str | None = None
        #: the running modules, innermost last (the caller of a layer's functional op): name, class name, module
        self.module_stack: list[tuple[str, str, nn.Module]] = []
        self.warned: set[tuple[str, str]] = set()
        self.depth = 0  # > 0 inside a handler: the ops it runs on local tensors are ours
        self.gathers = 0
        self.gathered_bytes = 0

    def where(self) -> str:
        if not self.module_stack:
            return "the LightningModule's step (outside any module)"
        name, cls, _ = self.module_stack[-1]
        return f"module '{name}' ({cls})"

    def clear_modules(self) -> None:
        """Forget the modules of an earlier step (one that raised leaves its modules on the stack)."""
        self.module_stack.clear()

    def caller(self) -> nn.Module | None:
        """The innermost module running (the layer whose functional op is being dispatched), if any."""
        return self.module_stack[-1][2] if self.module_stack else None

    def module_hooks(self, root: nn.Module, prefix: str = "") -> list[Any]:
        """Hooks keeping :attr:`module_stack` (the module names in error and warning messages)."""
        handles = []
        for name, m in root.named_modules(prefix=prefix):
            entry = (name or type(m).__name__, type(m).__name__, m)

            def pre(mod, args, entry=entry):
                self.module_stack.append(entry)

            def post(mod, args, out, entry=entry):
                if self.module_stack and self.module_stack[-1] == entry:
                    self.module_stack.pop()

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
        return handles


_STATE = DispatchState()


def state() -> DispatchState:
    return _STATE


@contextlib.contextmanager
def on_unsupported(mode: str):
    """Within the block, every split tensor's ops without a tiled form are gathered (``"gather"``) or refused
    (``"error"``), whatever its grid's policy says."""
    if mode not in ON_UNSUPPORTED:
        raise ValueError(f"on_unsupported={mode!r}: choose 'gather' or 'error'")
    old, _STATE.on_unsupported = _STATE.on_unsupported, mode
    try:
        yield
    finally:
        _STATE.on_unsupported = old

"""The dispatcher's per-process state: the modules running now (for the names in messages), whether a handler is
running (its ops on local tensors are the dispatch's own), the gather counters, a temporary override of the grids'
policy for ops without a tiled form (:func:`on_unsupported`, restored when its block ends), and the error every
refusal raises.

Nothing a run sets lives here: the strategy's settings (overlap, ``on_unsupported``), the record of parameters met
on tiles, the gathers already warned about and the convolutions K-FAC captures belong to the grid the split
tensors carry (:attr:`SpatialGrid.policy`, :attr:`SpatialGrid.tile_params`, :attr:`SpatialGrid.warned`,
:attr:`SpatialGrid.tiled_layers`), and the hooks that keep :attr:`DispatchState.module_stack` belong to the
strategy, which removes them (and empties the stack) at its teardown.  A second Trainer in the process, or a
plain run of the same modules, inherits nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from lightning_hpc.spatial.policy import ON_UNSUPPORTED


class SpatialDispatchError(RuntimeError):
    """An op on a spatially split activation that cannot be computed exactly (or gathering was disabled)."""


class DispatchState:
    """Per-process state: the modules running now (names for messages), the handler depth, the gather counters
    and a temporary override of what happens to ops without a tiled form (None: each grid's own policy)."""

    def __init__(self) -> None:
        self.on_unsupported: str | None = None
        #: the running modules, innermost last: (name, class name)
        self.module_stack: list[tuple[str, str]] = []
        self.depth = 0  # > 0 inside a handler: the ops it runs on local tensors are ours
        self.gathers = 0
        self.gathered_bytes = 0

    def where(self) -> str:
        if not self.module_stack:
            return "the LightningModule's step (outside any module)"
        name, cls = self.module_stack[-1]
        return f"module '{name}' ({cls})"

    def clear_modules(self) -> None:
        """Forget the modules of an earlier step (one that raised leaves its modules on the stack)."""
        self.module_stack.clear()

    def module_hooks(self, root: nn.Module, prefix: str = "") -> list[Any]:
        """Hooks keeping :attr:`module_stack` (the module names in error and warning messages); the caller removes
        them (``handle.remove()``) when its run ends."""
        handles = []
        for name, m in root.named_modules(prefix=prefix):
            entry = (name or type(m).__name__, type(m).__name__)

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

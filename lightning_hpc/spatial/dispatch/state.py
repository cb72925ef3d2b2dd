"""The dispatcher's per-process state: whether a handler is running (its ops on local tensors are the dispatch's
own), the gather counters, a temporary override of the grids' policy for ops without a tiled form
(:func:`on_unsupported`, restored when its block ends), and the error every refusal raises.

Nothing a run sets lives here: the strategy's settings (overlap, ``on_unsupported``), the record of parameters met
on tiles, the gathers already warned about, the convolutions K-FAC captures and the modules running now (a
:class:`ModuleTrace`, for the names in messages) belong to the grid the split tensors carry
(:attr:`SpatialGrid.policy`, :attr:`SpatialGrid.tile_params`, :attr:`SpatialGrid.warned`,
:attr:`SpatialGrid.tiled_layers`, :attr:`SpatialGrid.modules`), and the hooks that keep the trace belong to the
strategy, which removes them at its teardown.  A second Trainer in the process, or a plain run of the same modules,
inherits nothing.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_hpc.spatial.layout.policy import ON_UNSUPPORTED

if TYPE_CHECKING:
    from lightning_hpc.spatial.layout.tiling import SpatialGrid

#: where an op ran when no module of a traced run was running
OUTSIDE = "the LightningModule's step (outside any module)"


class SpatialDispatchError(RuntimeError):
    """An op on a spatially split activation that cannot be computed exactly (or gathering was disabled)."""


class DispatchState:
    """Per-process state: the handler depth, the gather counters and a temporary override of what happens to ops
    without a tiled form (None: each grid's own policy)."""

    def __init__(self) -> None:
        self.on_unsupported: str | None = None
        self.depth = 0  # > 0 inside a handler: the ops it runs on local tensors are ours
        self.gathers = 0
        self.gathered_bytes = 0


class ModuleTrace:
    """The modules of one run that are running now, innermost last (name, class name), kept by forward hooks
    (:meth:`hooks`) for the module names in error and warning messages.  The strategy owns one and puts it on its
    grid (:attr:`SpatialGrid.modules`)."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, str]] = []

    def where(self) -> str:
        if not self.stack:
            return OUTSIDE
        name, cls = self.stack[-1]
        return f"module '{name}' ({cls})"

    def clear(self) -> None:
        """Forget the modules of an earlier step (one that raised leaves its modules on the stack)."""
        self.stack.clear()

    def hooks(self, root: nn.Module, prefix: str = "") -> list[Any]:
        """Hooks keeping :attr:`stack`; the caller removes them (``handle.remove()``) when its run ends."""
        handles = []
        for name, m in root.named_modules(prefix=prefix):
            entry = (name or type(m).__name__, type(m).__name__)

            def pre(mod, args, entry=entry):
                self.stack.append(entry)

            def post(mod, args, out, entry=entry):
                if self.stack and self.stack[-1] == entry:
                    self.stack.pop()

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
        return handles


def where(grid: SpatialGrid | None) -> str:
    """The running module of ``grid``'s run (its :class:`ModuleTrace`), for messages."""
    trace = grid.modules if grid is not None else None
    return trace.where() if trace is not None else OUTSIDE


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

"""One verdict on a gradient overflow for all ranks of a model split over them.

A ``GradScaler`` (``precision='16-mixed'`` on a GPU, :class:`~lightning_hpc.KFACMixedPrecision`) skips the
optimizer step when a gradient holds an ``inf`` or a NaN and lowers its scale.  One process sees every gradient; a
rank of a strategy that splits the model (hybrid_fc's sharded head, multigrid's residual steps) sees only its
block, so an overflow in one rank's block would make that rank skip the step while the others take it: the split
parameters then hold a step that one process never took (or lack one it took), and the ranks' scales go apart.
With data parallelism alone the gradients are all-reduced before the check, so every rank finds the same.

:func:`agree_on_overflow` gives the precision plugin torch's ``ShardedGradScaler`` for the run (the scaler FSDP
uses: it all-reduces the per-device overflow flags over a process group inside ``unscale_``, so every rank skips
exactly when any rank found an overflow, as one process does); :func:`restore_scaler` hands the user's scaler back
after the run with the state it reached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["agree_on_overflow", "restore_scaler"]


def _sharded_grad_scaler() -> type[ShardedGradScaler]:
    """torch's ``ShardedGradScaler``, imported when a run needs it: its module imports FSDP, about a second of a
    small CPU's time that a program importing this package's cores without mixed precision should not pay."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Scaler

    return Scaler


def agree_on_overflow(precision_plugin: Any, device_type: str,
                      group: dist.ProcessGroup | None = None) -> torch.amp.GradScaler | None:
    """Give ``precision_plugin`` (its ``scaler``) a scaler whose overflow verdict is all-reduced over ``group``
    (``None``: every rank), starting from the state of the one it had; returns that one (``None``: nothing was
    replaced, the plugin has no enabled scaler or already agrees)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    sharded = _sharded_grad_scaler()
    if isinstance(scaler, sharded):
        return None
    state = scaler.state_dict()
    agreeing = sharded(device=device_type, init_scale=state["scale"], growth_factor=state["growth_factor"],
                       backoff_factor=state["backoff_factor"], growth_interval=state["growth_interval"],
                       process_group=group if group is not None else dist.group.WORLD)
    agreeing.load_state_dict(state)  # the growth tracker too
    precision_plugin.scaler = agreeing
    return scaler


def restore_scaler(precision_plugin: Any, original: torch.amp.GradScaler | None) -> None:
    """Put ``original`` (what :func:`agree_on_overflow` returned) back on ``precision_plugin`` with the state the
    run's scaler reached (its scale and growth tracker)."""
    if original is None:
        return
    current = getattr(precision_plugin, "scaler", None)
    if isinstance(current, _sharded_grad_scaler()):
        original.load_state_dict(current.state_dict())
    precision_plugin.scaler = original

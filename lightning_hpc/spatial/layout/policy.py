"""The dispatch policy of one spatial grid: the strategy's settings for the op dispatch, carried by the grid every
split tensor holds (as a DTensor carries its spec), so two strategies in one process, or a split tensor used
outside the training step, each see their own settings and never the last ones another run set.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DispatchPolicy", "ON_UNSUPPORTED"]

#: what happens to an op without a tiled form: computed exactly on the gathered whole activation (with a one-time
#: warning), or refused
ON_UNSUPPORTED = ("gather", "error")


@dataclass
class DispatchPolicy:
    """``overlap``: convolutions wait for their halo after the tile's own convolution (section IV-A);
    ``on_unsupported``: ``"gather"`` or ``"error"`` (:data:`ON_UNSUPPORTED`)."""

    overlap: bool = False
    on_unsupported: str = "gather"

    def __post_init__(self) -> None:
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported={self.on_unsupported!r}: choose 'gather' or 'error'")

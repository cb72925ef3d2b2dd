"""The reentrant activation checkpoint on split activations, refused by name.

``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)`` runs ``fn`` inside a custom autograd
``Function`` (``CheckpointFunction``).  A ``Function`` is not an op the dispatch sees: autograd records the split
activation's output by its global shape while the gradient that comes back is the tile's, and the backward pass
ends in torch's shape mismatch.  The non-reentrant checkpoint (``use_reentrant=False``, torch's recommended
form) records and recomputes the ops themselves, which the dispatch computes on the tiles as usual.  While a
spatial strategy runs, ``CheckpointFunction.forward`` refuses split inputs with that fix (:func:`refuse_reentrant`).
"""

from __future__ import annotations

from typing import Any

from lightning_hpc.spatial.dispatch.state import SpatialDispatchError, where
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor

_ORIGINAL: dict[str, Any] = {}  # CheckpointFunction.forward as torch defines it, while the refusal is in place


def refuse_reentrant(on: bool) -> None:
    """Put the refusal in place (``on``) or take it away; idempotent."""
    from torch.utils import checkpoint

    function = checkpoint.CheckpointFunction
    if on and not _ORIGINAL:
        _ORIGINAL["forward"] = function.__dict__["forward"]
        original = function.forward

        def forward(ctx: Any, run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            split = next((a for a in args if isinstance(a, SpatialTensor)), None)
            if split is not None:
                raise SpatialDispatchError(
                    f"spatial: torch.utils.checkpoint.checkpoint(..., use_reentrant=True) in {where(split._grid)} "
                    f"got a split activation; the reentrant checkpoint's autograd Function would see its global shape "
                    f"while its gradient is the tile's. Pass use_reentrant=False (the ops are then recorded, "
                    f"recomputed and computed on the tiles as usual)"
                )
            return original(ctx, run_function, preserve_rng_state, *args)

        function.forward = staticmethod(forward)  # type: ignore[method-assign,assignment]
    elif not on and _ORIGINAL:
        function.forward = _ORIGINAL.pop("forward")  # type: ignore[method-assign]

"""``KFACMixedPrecision``: Lightning's mixed-precision plugin, telling K-FAC what the grad scaler did.

Under ``16-mixed`` the backward pass runs on a loss multiplied by the scaler's scale ``S``, so the output
gradients K-FAC's hooks capture are ``S`` times too large (G ``S^2`` times), and a step whose gradients overflow
is skipped by the scaler: its statistics must not enter the running factor averages. Lightning unscales the
parameter gradients before ``on_before_optimizer_step`` but has no notion of other captured tensors; this plugin
records, at that moment, the scale the backward pass used and whether the scaler found inf/nan, and the
:class:`~lightning_hpc.kfac.callback.KFAC` callback passes both to the preconditioner (``grad_scale``, or
``discard_statistics()`` on a skipped step).

Under ``bf16-mixed`` (no scaler) it behaves like Lightning's plugin; K-FAC keeps factors and decompositions in
float32 in every precision, since its hooks cast what they capture.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_hpc._compat import scaler_found_inf

__all__ = ["KFACMixedPrecision"]


class KFACMixedPrecision(MixedPrecision):
    """``MixedPrecision`` that exposes the loss scale and the inf/nan verdict of each optimizer step.

    Use ``Trainer(plugins=[KFACMixedPrecision("16-mixed", device="cuda")], callbacks=[KFAC(...)])`` (no
    ``precision=`` argument), or ``precision=kfac_16-mixed`` in the Hydra recipes.
    """

    def __init__(
        self, precision: str = "16-mixed", device: str = "cuda", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.kfac_grad_scale = 1.0
        self.kfac_found_inf = False

    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # Runs after scaler.unscale_ and before on_before_optimizer_step (where the KFAC callback reads these)
        # and before scaler.update() changes the scale: get_scale() is the scale this backward pass used.
        if self.scaler is not None and self.scaler.is_enabled():
            self.kfac_grad_scale = float(self.scaler.get_scale())
            self.kfac_found_inf = self._found_inf(optimizer)
        else:
            self.kfac_grad_scale, self.kfac_found_inf = 1.0, False
        super()._after_closure(model, optimizer)

    def _found_inf(self, optimizer: Any) -> bool:
        assert self.scaler is not None
        # The verdict scaler.unscale_ recorded for this optimizer (the one scaler.step acts on). GradScaler keeps
        # it in a private table; if that ever changes we check the gradients ourselves (same answer, one pass).
        found = scaler_found_inf(self.scaler, optimizer)
        if found is not None:
            return found
        return any(
            p.grad is not None and not bool(torch.isfinite(p.grad).all())
            for group in optimizer.param_groups
            for p in group["params"]
        )

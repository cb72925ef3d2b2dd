"""``SegmentationModule``: per-pixel binary segmentation (the mesh-tangling task, Dryden et al. section VI).

The loss is the sum of the per-pixel losses divided by the number of pixels of the *whole* samples, so that under
spatial parallelism (each rank holds a tile) the tiles' losses add up to the loss of the unpartitioned samples and
the summed weight gradients equal the serial ones.  The divisor comes from the strategy:
``trainer.strategy.global_pixel_count(local_target)`` when the strategy defines it (the spatial strategy returns
the pixel count of the full samples of this rank's sample group), else ``local_target.numel()`` (every rank holds
whole samples).  Metrics are torchmetrics' binary IoU (Jaccard) and F1, fed as on one process; under the
spatial strategy each rank counts its own tile and the counts are summed over all ranks at compute time
(:mod:`lightning_hpc.spatial.lightning.metrics`), so they are exact for tiles too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import BinaryF1Score, BinaryJaccardIndex
from typing_extensions import override

from lightning_hpc.modules.classification import with_step_scheduler

__all__ = ["SegmentationModule", "pixel_loss_sum"]


def pixel_loss_sum(logits: torch.Tensor, target: torch.Tensor, pos_weight: float | None = None) -> torch.Tensor:
    """Sum over pixels of the binary cross-entropy with logits (``pos_weight`` up-weights positive pixels)."""
    if logits.shape != target.shape:
        raise ValueError(f"prediction shape {tuple(logits.shape)} differs from the target's {tuple(target.shape)}")
    weight = None if pos_weight is None else torch.as_tensor(pos_weight, dtype=logits.dtype, device=logits.device)
    return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), pos_weight=weight, reduction="sum")


class SegmentationModule(pl.LightningModule):
    """``model`` maps ``(N, C, H, W)`` to one logit per pixel ``(N, 1, H, W)``; ``optimizer`` / ``scheduler`` are
    factories (Hydra ``_partial_``), as for :class:`lightning_hpc.ImageClassifier`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        pos_weight: float | None = None,
        threshold: float = 0.5,
    ) -> None:
        super().__init__()
        if pos_weight is not None and pos_weight <= 0:
            raise ValueError(f"task.pos_weight must be positive (or null), got {pos_weight}")
        if not 0 < threshold < 1:
            raise ValueError(f"task.threshold must be in (0, 1), got {threshold}")
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        self.model = model
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3))
        self.scheduler_factory = scheduler
        self.pos_weight = pos_weight
        self.train_iou = BinaryJaccardIndex(threshold=threshold)
        self.val_iou = BinaryJaccardIndex(threshold=threshold)
        self.val_f1 = BinaryF1Score(threshold=threshold)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def total_pixels(self, target: torch.Tensor) -> int:
        """Pixels of the full samples this rank's tile belongs to (strategy contract, see module docstring)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        count = getattr(strategy, "global_pixel_count", None)
        return int(count(target)) if callable(count) else target.numel()

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Sum of this rank's per-pixel losses / pixels of the full samples."""
        return pixel_loss_sum(logits, target, self.pos_weight) / self.total_pixels(target)

    def _log_loss(self, name: str, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, sync: bool) -> None:
        # For display, the per-pixel mean over this rank's pixels; averaging it over ranks gives the loss of the
        # whole samples (exact when tiles are equal).
        local_mean = loss.detach() * (self.total_pixels(target) / target.numel())
        self.log(name, local_mean, prog_bar=True, sync_dist=sync, batch_size=target.shape[0])

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        logits = self(x)
        loss = self.loss(logits, target)
        self._log_loss("train/loss", logits, target, loss, sync=False)
        self.train_iou(torch.sigmoid(logits.detach()), target.int())
        self.log("train/iou", self.train_iou, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, target = batch
        logits = self(x)
        self._log_loss("val/loss", logits, target, self.loss(logits, target), sync=True)
        probs, labels = torch.sigmoid(logits), target.int()
        self.val_iou(probs, labels)
        self.val_f1(probs, labels)
        self.log("val/iou", self.val_iou, prog_bar=True)
        self.log("val/f1", self.val_f1)

    @override
    def configure_optimizers(self) -> Any:
        return with_step_scheduler(self.trainer, self.optimizer_factory(self.parameters()), self.scheduler_factory)

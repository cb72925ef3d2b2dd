"""The generic LightningModule: any ``nn.Module`` classifier + loss + torchmetrics accuracy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_hpc.modules.lr_scaling import ScalingRule, scale_hparams
from lightning_hpc.protocols import data_parallel_size

__all__ = ["ImageClassifier", "classification_loss", "with_step_scheduler"]

LOSSES = ("cross_entropy", "logistic")


def classification_loss(
    logits: torch.Tensor, target: torch.Tensor, kind: str = "cross_entropy", label_smoothing: float = 0.0
) -> torch.Tensor:
    """``cross_entropy`` (softmax) or ``logistic`` (independent sigmoid units per class, as the one-weird-trick
    paper's model uses); both with label smoothing."""
    if kind == "cross_entropy":
        return F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    if kind == "logistic":
        onehot = F.one_hot(target, logits.shape[-1]).to(logits.dtype)
        onehot = onehot * (1 - label_smoothing) + label_smoothing / logits.shape[-1]
        return F.binary_cross_entropy_with_logits(logits, onehot, reduction="sum") / logits.shape[0]
    raise ValueError(f"task.loss must be one of {LOSSES}, got {kind!r}")


def with_step_scheduler(
    trainer: pl.Trainer, optimizer: torch.optim.Optimizer, scheduler_factory: Callable[..., Any] | None
) -> Any:
    """``configure_optimizers`` return value: the optimizer, plus the scheduler built by ``scheduler_factory``
    (called with ``steps_per_epoch``) and stepped every optimizer step."""
    if scheduler_factory is None:
        return optimizer
    max_epochs = max(trainer.max_epochs or 1, 1)
    steps_per_epoch = max(trainer.estimated_stepping_batches / max_epochs, 1)
    scheduler = scheduler_factory(optimizer, steps_per_epoch=steps_per_epoch)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ImageClassifier(pl.LightningModule):
    """``model`` is a plain ``nn.Module``; ``optimizer`` and ``scheduler`` are factories (Hydra ``_partial_``)
    called with the parameters / the optimizer, so lr scaling can use the real global batch size."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        num_classes: int = 10,
        loss: str = "cross_entropy",
        label_smoothing: float = 0.0,
        lr_scaling: dict[str, Any] | ScalingRule | None = None,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"task.loss must be one of {LOSSES}, got {loss!r}")
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        self.model = model
        self.optimizer_factory = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        self.scheduler_factory = scheduler
        self.loss_kind, self.label_smoothing = loss, label_smoothing
        self.lr_scaling = lr_scaling if isinstance(lr_scaling, ScalingRule) else ScalingRule(**(lr_scaling or {}))
        self.train_acc = MulticlassAccuracy(num_classes, top_k=1)
        self.val_acc = MulticlassAccuracy(num_classes, top_k=1)
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return classification_loss(logits, y, self.loss_kind, self.label_smoothing)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=False)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.val_acc5(logits, y)
        self.log("val/loss", self.loss(logits, y), sync_dist=True, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/acc_top5", self.val_acc5)

    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (per-rank batch x data-parallel ranks x accumulation)."""
        trainer = self.trainer
        # set by Lightning, undeclared on Trainer
        per_rank = getattr(trainer.datamodule, "batch_size", None) or 1  # type: ignore[attr-defined]
        dp = data_parallel_size(trainer.strategy)
        return int(per_rank * dp * trainer.accumulate_grad_batches)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.lr_scaling.rule != "none":
            batch = self.global_batch_size()
            for group in optimizer.param_groups:
                group["lr"], group["weight_decay"] = scale_hparams(
                    group["lr"], group.get("weight_decay", 0.0), batch, self.lr_scaling
                )
                group["initial_lr"] = group["lr"]
        return with_step_scheduler(self.trainer, optimizer, self.scheduler_factory)

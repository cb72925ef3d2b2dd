"""An EMA of the model as users write one inside their LightningModule (timm's ``ModelEmaV2``): a frozen deep copy,
updated element-wise over the two ``state_dict``s after each batch.  Shared by the tests of the strategies that
split the model and must split such a copy alike."""

from __future__ import annotations

import copy

import torch
from torch import nn


class ModelEma(nn.Module):
    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(self.decay * ema_v + (1.0 - self.decay) * model_v)

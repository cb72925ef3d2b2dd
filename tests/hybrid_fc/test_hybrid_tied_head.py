"""A head layer tied to another layer (one tensor in both places) is refused before anything is split, naming both
places; the same model untied is split."""

import pytest
import torch
from torch import nn

from lightning_hpc.hybrid_fc.parallel import parallelize_head


class _Net(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
        self.aux = nn.Linear(16, 8)
        if tie:
            self.aux.weight = self.classifier[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        return self.classifier(h + 0.1 * torch.tanh(self.aux(h)) @ self.aux.weight)


def test_tied_to_a_trunk_layer_is_refused_by_name():
    with pytest.raises(ValueError, match=r"head's parameter 'classifier.0.weight' is tied to 'aux.weight'.*Untie"):
        parallelize_head(_Net(tie=True), head="classifier")


def test_untied_model_is_split():
    model = parallelize_head(_Net(tie=False), head="classifier")
    assert "HybridHead" in {type(m).__name__ for m in model.modules()}

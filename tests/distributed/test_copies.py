"""Copies of a split module are found by their tensors (``distributed/copies.py``): an EMA's deep copy of the
whole model, of the split part alone, or inside a wrapper; modules of other shapes or dtypes are not copies."""

import copy

import torch
from torch import nn

from lightning_hpc.distributed.copies import copies_of


class Ema(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)


def _user_module() -> nn.Module:
    root = nn.Module()
    root.model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5)), nn.Linear(5, 3))
    return root


def test_an_emas_deep_copy_of_the_model_is_found_at_the_split_parts_place():
    root = _user_module()
    root.ema = Ema(root.model)
    root.trunk_ema = copy.deepcopy(root.model[1])  # a copy of the split part alone
    root.other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 6))  # other shapes: not a copy
    root.half = copy.deepcopy(root.model).to(torch.float64)  # another dtype: not a copy
    assert [c.path for c in copies_of(root, "model.1")] == ["ema.module.1", "trunk_ema"]
    assert [c.whole for c in copies_of(root, "model.1")] == ["ema.module", "trunk_ema"]
    assert [c.path for c in copies_of(root, "model")] == ["ema.module"]


def test_a_module_without_copies_has_none():
    root = _user_module()
    root.shares = nn.Sequential(root.model[0], root.model[1], root.model[2])  # the model's own tensors: no copy
    assert copies_of(root, "model.1") == []
    assert copies_of(root, "model") == []

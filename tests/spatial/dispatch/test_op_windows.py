"""A layer's windows come from the op it calls, as that op's handler registered them (``_handles(...,
windows=...)``): the setup check and the planner see a user's layer that calls ``F.conv2d`` itself, or pads before
an ``nn.Conv2d``, as the tile kernels run it, and probing a layer changes nothing in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.spatial.dispatch.registry import OP_WINDOWS
from lightning_hpc.spatial.dispatch.split_check import check_split
from lightning_hpc.spatial.dispatch.windows import layer_windows
from lightning_hpc.spatial.layout.halo_exchange import PartitionError, Window1d


class FunctionalConv(nn.Module):
    """A user's layer with its own weight, calling the functional convolution (no ``nn.Conv2d``)."""

    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 2, kernel, kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, padding=self.weight.shape[-1] // 2)


class PaddedConv(nn.Conv2d):
    """A ``Conv2dSame``-style layer: pads inside its forward (here one row and column after), then convolves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (0, 1, 0, 1)))


def test_a_functional_convolution_has_the_windows_of_the_module():
    assert layer_windows(FunctionalConv(5), (1, 2, 8, 8), (1, 3, 8, 8)) == \
        layer_windows(nn.Conv2d(2, 3, 5, padding=2), (1, 2, 8, 8), (1, 3, 8, 8)) == (Window1d(5, 1, 2),) * 2


def test_padding_before_the_convolution_becomes_the_windows_padding():
    assert layer_windows(PaddedConv(2, 3, 2, stride=2), (1, 2, 8, 8), (1, 3, 4, 4)) == \
        (Window1d(2, 2, 0, padding_hi=1),) * 2
    reflect = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
    assert layer_windows(reflect, (1, 2, 8, 8), (1, 3, 8, 8)) == (Window1d(3, 1, 1),) * 2


def test_the_setup_check_refuses_a_tile_thinner_than_a_functional_layers_halo():
    model = nn.Sequential(FunctionalConv(7), nn.ReLU())  # a halo of 3 rows: a 2-row tile cannot hold it
    check_split(model, (2, 8, 8), (2, 1))
    with pytest.raises(PartitionError):
        check_split(model, (2, 8, 8), (4, 1))


def test_probing_changes_nothing_in_the_layer():
    bn = nn.BatchNorm2d(2)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    assert layer_windows(bn, (4, 2, 8, 8), (4, 2, 8, 8)) is None
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())
    assert layer_windows(nn.ReLU(), (1, 2, 8, 8), (1, 2, 8, 8)) is None


def test_every_halo_op_family_registered_its_windows():
    names = {getattr(f, "__name__", str(f)) for f in OP_WINDOWS}
    for k in (1, 2, 3):
        assert {f"conv{k}d", f"conv_transpose{k}d", f"max_pool{k}d", f"avg_pool{k}d"} <= names, names
    assert "interpolate" in names

import pytest
import torch
from torch import nn

from lightning_hpc.models import build_model, mesh_fcn
from lightning_hpc.modules.segmentation import SegmentationModule, pixel_loss_sum


@pytest.mark.parametrize("convs", [3, 5])
def test_mesh_fcn_shapes_and_layers(convs):
    torch.manual_seed(0)
    model = mesh_fcn(convs_per_block=convs, widths=(4, 4, 8, 8, 8, 8))
    y = model(torch.randn(2, 18, 128, 64))
    assert y.shape == (2, 1, 128, 64)
    convs_ = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs_) == 6 * convs + 1
    strided = [m for m in convs_ if m.stride == (2, 2)]
    assert len(strided) == 6 and all(m.kernel_size == (3, 3) for m in convs_[:-1])
    allowed = (nn.Sequential, nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Upsample)
    assert all(isinstance(m, allowed) for m in model.modules())
    assert isinstance(build_model("mesh_fcn"), nn.Module)


class _SpatialStub:
    """What the spatial strategy provides: the pixel count of the whole samples of this rank's tile."""

    def __init__(self, total):
        self.total = total

    def global_pixel_count(self, local_target):
        return self.total


class _TrainerStub:
    def __init__(self, strategy):
        self.strategy = strategy


def test_loss_normalised_over_whole_samples():
    torch.manual_seed(0)
    logits = torch.randn(2, 1, 12, 10, requires_grad=True)
    target = (torch.rand(2, 1, 12, 10) < 0.2).float()
    module = SegmentationModule(nn.Identity(), pos_weight=3.0)
    full = module.loss(logits, target)  # no trainer: divides by the local numel
    manual = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, pos_weight=torch.tensor(3.0))
    torch.testing.assert_close(full, manual)
    (g_full,) = torch.autograd.grad(full, logits)

    # Four tiles (uneven), each normalised by the full pixel count: losses and gradients add up to the full ones.
    module._trainer = _TrainerStub(_SpatialStub(target.numel()))
    total, grad = 0.0, torch.zeros_like(logits)
    for rs in (slice(0, 7), slice(7, 12)):
        for cs in (slice(0, 4), slice(4, 10)):
            tile = logits.detach()[:, :, rs, cs].clone().requires_grad_(True)
            loss = module.loss(tile, target[:, :, rs, cs])
            (g,) = torch.autograd.grad(loss, tile)
            total = total + loss.detach()
            grad[:, :, rs, cs] = g
    module._trainer = None
    torch.testing.assert_close(total, full.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, g_full, rtol=1e-6, atol=1e-9)


def test_loss_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="differs"):
        pixel_loss_sum(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 5))
    with pytest.raises(ValueError, match="pos_weight"):
        SegmentationModule(nn.Identity(), pos_weight=-1.0)

import pytest
import torch
from torch import nn

from lightning_hpc.models import ODEResNet, ResidualStep, build_model, ode_resnet, paper_inference_net
from lightning_hpc.multigrid.ode_form import NotResidualError, residual_steps


def test_ode_resnet_is_forward_euler():
    torch.manual_seed(0)
    net = ode_resnet(1, 10, (8, 8), width=4, num_steps=6, final_time=3.0)
    assert isinstance(net, ODEResNet) and len(net.steps) == 6
    assert all(isinstance(s, ResidualStep) and s.h == pytest.approx(0.5) for s in net.steps)
    x = torch.randn(3, 1, 8, 8)
    u = net.opening(x)
    for s in net.steps:  # u_{n+1} = u_n + h F(u_n)  (Eq. 1)
        u = u + 0.5 * s.branch(u)
    assert torch.allclose(net.closing(u), net(x), atol=1e-6)
    assert net(x).shape == (3, 10)


def test_paper_inference_net_configuration():
    # Section IV-C: 7x7 conv, 50 channels, padding 1, ReLU; residual 7x7 convs; FC to 10 classes.
    net = paper_inference_net(num_steps=3)
    conv = net.opening[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.padding) == (1, 50, (7, 7), (1, 1))
    assert all(s.branch[0].kernel_size == (7, 7) and s.branch[0].out_channels == 50 for s in net.steps)
    assert net.closing[-1].in_features == 50 * 24 * 24 and net.closing[-1].out_features == 10
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("ode_resnet", num_steps=2)(torch.randn(1, 1, 8, 8)).shape == (1, 10)


def test_batch_norm_option():
    net = ode_resnet(num_steps=2, batch_norm=True)
    assert isinstance(net.steps[0].branch[1], nn.BatchNorm2d)


def test_plain_block_is_named_in_error():
    steps = nn.Sequential(ResidualStep(nn.Conv2d(4, 4, 3, padding=1), 0.1), nn.Conv2d(4, 4, 3, padding=1))
    with pytest.raises(NotResidualError, match=r"block 1 \(Conv2d"):
        residual_steps(steps)


def test_shape_change_is_named_in_error():
    steps = nn.Sequential(
        ResidualStep(nn.Conv2d(4, 4, 3, padding=1), 0.1),
        ResidualStep(nn.Conv2d(4, 4, 3, padding=1), 0.1),
        ResidualStep(nn.Conv2d(4, 4, 3), 0.1),  # no padding: 8x8 -> 6x6
    )
    with pytest.raises(NotResidualError, match=r"block 2 .* maps a state of shape \(1, 4, 8, 8\) to \(1, 4, 6, 6\)"):
        residual_steps(steps, torch.zeros(1, 4, 8, 8))


def test_not_a_sequence_error():
    with pytest.raises(NotResidualError, match="nn.Sequential"):
        residual_steps(nn.Conv2d(1, 1, 1))


class _LooksResidual(nn.Module):
    """Has `branch` and `h` like a residual step, but computes something else."""

    def __init__(self) -> None:
        super().__init__()
        self.branch, self.h = nn.Conv2d(4, 4, 3, padding=1), 0.1

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u - self.h * torch.tanh(self.branch(u))


class _SubclassOverridingForward(ResidualStep):
    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return 2 * u + self.h * self.branch(u)


class _SubclassKeepingForward(ResidualStep):
    pass


@pytest.mark.parametrize("block", [_LooksResidual(), _SubclassOverridingForward(nn.Conv2d(4, 4, 3, padding=1), 0.1)])
def test_block_with_its_own_forward_is_refused(block):
    steps = nn.Sequential(ResidualStep(nn.Conv2d(4, 4, 3, padding=1), 0.1), block)
    with pytest.raises(NotResidualError, match=r"block 1 .* its own forward\(\).*ResidualStep\(branch, h\)"):
        residual_steps(steps)


def test_subclass_keeping_forward_is_accepted():
    steps = nn.Sequential(_SubclassKeepingForward(nn.Conv2d(4, 4, 3, padding=1), 0.1))
    assert len(residual_steps(steps, torch.zeros(1, 4, 8, 8))) == 1

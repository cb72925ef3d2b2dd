"""The spatial strategy's op dispatch and tile kernels on the GPU: a split activation over one tile runs every op of
a U-Net-like stack through the handlers (convolutions with zero and reflect padding, batch and group norm,
pooling, bilinear upsampling, transposed convolution, adaptive pooling, a mean loss), on the device and on the
CPU; output, input gradient and parameter gradients must agree.  (Several tiles exchange halos over NCCL, which
needs two GPUs: not run here.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from torch import nn

from lightning_hpc.spatial.dispatch import SpatialTensor, split_tensor
from lightning_hpc.spatial.layout.tiling import SpatialGrid


def _net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.GroupNorm(2, 8),
        nn.Upsample(scale_factor=2, mode="bilinear"), nn.ConvTranspose2d(8, 4, 2, stride=2), nn.AvgPool2d(2),
        nn.Conv2d(4, 2, 1),
    ).to(dtype)


def _run(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    net = _net(dtype).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 14, 10, generator=g, dtype=dtype).to(device).requires_grad_()
    y = torch.randn(2, 2, 14, 10, generator=g, dtype=dtype).to(device)
    grid = SpatialGrid.single()
    xs = split_tensor(x, grid, tuple(x.shape))
    out = net(xs)
    assert isinstance(out, SpatialTensor), "the activation left the dispatch path"
    F.mse_loss(out, split_tensor(y, grid, tuple(y.shape))).backward()
    assert x.grad is not None
    return out.detach().as_subclass(torch.Tensor).cpu(), x.grad.cpu(), [p.grad.cpu() for p in net.parameters()]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["float64", "float32"])
def test_dispatch_path_on_device_equals_cpu(dtype: torch.dtype, tol: float) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    on_device, on_cpu = _run(DEVICE, dtype), _run("cpu", dtype)
    for what, a, b in (("output", on_device[0], on_cpu[0]), ("input gradient", on_device[1], on_cpu[1]),
                       *(("parameter gradient", a, b) for a, b in zip(on_device[2], on_cpu[2]))):
        scale = max(float(b.abs().max()), 1.0)
        assert float((a - b).abs().max()) <= tol * scale, f"{what}: {DEVICE} vs cpu"

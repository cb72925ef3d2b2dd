"""ODE residual networks: an opening layer, N forward-Euler residual steps, closing layers.

Kirby et al., "Layer-parallel training with GPU concurrency of deep residual neural networks via nonlinear
multigrid", Eq. (1): ``u_{n+1} = u_n + h F(u_n; theta_n)``, n = 0..N-1, the forward-Euler discretisation of
``du/dt = F(u; theta(t))`` (Eq. 2).  The multigrid strategy solves the N steps in parallel; it needs the trunk
in exactly this form, which :func:`lightning_hpc.multigrid.ode_form.residual_steps` checks and explains when a
model does not fit.

Configurations of the paper (section IV):

* :func:`paper_inference_net` (IV-C): 7x7 opening conv with 50 channels, padding 1, ReLU; 4,092 residual 7x7
  conv + ReLU steps of the same width; FC to 10 classes + softmax (cross-entropy).
* ``ODEResNet`` with any width / depth / kernel / optional batch normalisation for smaller studies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "ResidualStep",
    "conv_branch",
    "ODEResNet",
    "ode_resnet",
    "paper_inference_net",
]


class ResidualStep(nn.Module):
    """One forward-Euler step ``u + h * branch(u)`` (Eq. 1); ``branch`` is F, ``h`` the step size."""

    def __init__(self, branch: nn.Module, h: float) -> None:
        super().__init__()
        if not h > 0:
            raise ValueError(f"step size h must be positive, got {h}")
        self.branch = branch
        self.h = float(h)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u + self.h * self.branch(u)

    def extra_repr(self) -> str:
        return f"h={self.h:g}"


def conv_branch(channels: int, kernel_size: int = 3, batch_norm: bool = False, bias: bool = True) -> nn.Sequential:
    """F(u) = ReLU(BN(conv(u))) with 'same' padding so the state keeps its shape (a residual step needs it)."""
    if kernel_size % 2 != 1:
        raise ValueError(f"kernel_size must be odd so a residual conv keeps the state's shape, got {kernel_size}")
    layers: list[nn.Module] = [
        nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, bias=bias and not batch_norm)
    ]
    if batch_norm:
        layers.append(nn.BatchNorm2d(channels))
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ODEResNet(nn.Module):
    """``closing(steps(opening(x)))`` where ``steps`` is an ``nn.Sequential`` of :class:`ResidualStep`.

    The attribute names ``opening``, ``steps`` and ``closing`` are what the multigrid strategy looks for
    (``MultigridStrategy(trunk="steps")``).
    """

    def __init__(self, opening: nn.Module, steps: nn.Sequential, closing: nn.Module) -> None:
        super().__init__()
        self.opening, self.steps, self.closing = opening, steps, closing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.closing(self.steps(self.opening(x)))


def ode_resnet(
    in_channels: int = 1,
    num_classes: int = 10,
    input_size: Sequence[int] | int = (8, 8),
    width: int = 8,
    num_steps: int = 32,
    kernel_size: int = 3,
    opening_kernel: int = 3,
    opening_padding: int | None = None,
    final_time: float = 1.0,
    h: float | None = None,
    batch_norm: bool = False,
    pool: int | None = None,
) -> ODEResNet:
    """Build an ODE-ResNet.

    Args:
        input_size: (H, W) of the input images (the closing FC needs the flattened size).
        width: channels of the state u.
        num_steps: N, the number of residual steps (the network has N + 2 weight layers).
        h: step size; default ``final_time / num_steps`` (the ODE view: deeper = finer time grid).
        opening_padding: padding of the opening conv (default 'same'); the paper uses 1 with a 7x7 kernel.
        pool: if set, adaptive average pooling to ``pool x pool`` before the FC; ``None`` flattens the state
            (the paper's FC on the whole state).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    hh, ww = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
    pad = opening_kernel // 2 if opening_padding is None else opening_padding
    out_h, out_w = hh + 2 * pad - opening_kernel + 1, ww + 2 * pad - opening_kernel + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(
            f"opening conv {opening_kernel}x{opening_kernel}, padding {pad} leaves no output for input {hh}x{ww}"
        )
    step = final_time / num_steps if h is None else h
    opening = nn.Sequential(nn.Conv2d(in_channels, width, opening_kernel, padding=pad), nn.ReLU())
    steps = nn.Sequential(*[ResidualStep(conv_branch(width, kernel_size, batch_norm), step) for _ in range(num_steps)])
    closing_layers: list[nn.Module] = []
    if pool is not None:
        closing_layers.append(nn.AdaptiveAvgPool2d(pool))
        out_h = out_w = pool
    closing_layers += [nn.Flatten(1), nn.Linear(width * out_h * out_w, num_classes)]
    return ODEResNet(opening, steps, nn.Sequential(*closing_layers))


def paper_inference_net(
    num_steps: int = 4092, width: int = 50, num_classes: int = 10, input_size: int = 28, h: float = 1.0
) -> ODEResNet:
    """Section IV-C's network: 7x7 conv (50 channels, padding 1, ReLU), 4,092 residual 7x7 conv + ReLU steps,
    FC to 10 classes (softmax / cross-entropy in the loss).

    The paper states 3,248,524 parameters for this network; 50-channel 7x7 convs give ~122.5k parameters per
    step, so the paper's count cannot be reproduced from its text (see docs/multigrid.md).
    """
    return ode_resnet(
        1, num_classes, input_size, width, num_steps, kernel_size=7, opening_kernel=7, opening_padding=1, h=h
    )

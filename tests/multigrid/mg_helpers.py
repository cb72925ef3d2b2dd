"""Shared fixtures of the multigrid tests: a small float64 ODE-ResNet and a serial reference."""

from __future__ import annotations

import copy

import torch

from lightning_hpc.models import ode_resnet
from lightning_hpc.multigrid import MultigridODEBlock, MultigridOptions, SolveSettings


def make_net(num_steps: int = 32, width: int = 4, seed: int = 0, batch_norm: bool = False, final_time: float = 2.0):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # same initial weights whatever the caller's default dtype
    torch.manual_seed(seed)
    net = ode_resnet(1, 10, 8, width=width, num_steps=num_steps, final_time=final_time, batch_norm=batch_norm).double()
    torch.set_default_dtype(previous)
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return net, x


def options(
    levels: int, cfactor: int, cycles: int, relaxation: str = "FCF", tol=None, bwd_cycles=None, concurrent=True
) -> MultigridOptions:
    return MultigridOptions(
        cfactor=cfactor,
        levels=levels,
        relaxation=relaxation,
        forward=SolveSettings(cycles, tol),
        backward=SolveSettings(bwd_cycles or cycles, tol),
        concurrent=concurrent,
    )


def serial_reference(net, x):
    """Output, dL/dx and dL/dtheta of the plain network (autograd), L = sum(logits * fixed weights)."""
    net = copy.deepcopy(net)
    x = x.clone().requires_grad_()
    logits = net(x)
    w = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
    (logits * w).sum().backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in net.named_parameters()}
    return logits.detach(), x.grad.detach(), grads


def multigrid_run(net, x, opts, group=None):
    """Same as :func:`serial_reference` with the trunk replaced by a MultigridODEBlock."""
    net = copy.deepcopy(net)
    net.steps = MultigridODEBlock(net.steps, opts, group=group)
    x = x.clone().requires_grad_()
    logits = net(x)
    w = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
    (logits * w).sum().backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in net.named_parameters()}
    return logits.detach(), x.grad.detach(), grads, net.steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))

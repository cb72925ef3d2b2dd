"""Gradient buckets of layered SGD (single process, a recording stand-in for the hierarchical reduction).

What the overlap with the backward pass relies on: bucket assignment in reverse parameter order with DDP's
size caps, buckets started from gradient hooks *before* the backward pass ends, in bucket order even when a
parameter has no gradient, ``no_sync`` for accumulation micro-batches (and a clear error without it), and the
round trip through the buffers giving back exactly the gradients (grad=None for parameters without one).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate, assign_buckets


class _Recorder:
    """Stands in for HierarchicalAllreduce on one rank: the mean over one rank is the buffer itself."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.started = events, []

    def start(self, buffer: torch.Tensor) -> None:
        self.events.append(f"start {len(self.started)}")
        self.started.append(buffer.clone())

    def finish(self) -> list[torch.Tensor]:
        out, self.started = self.started, []
        return out


class _MarkInputGrad(torch.autograd.Function):
    """Identity whose backward (the very last op of the backward pass) records an event."""

    @staticmethod
    def forward(ctx, x, events):
        ctx.events = events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.events.append("backward reached the input")
        return g, None


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 2)).double()


def test_assign_buckets_reverse_order_and_caps():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 10)]  # float32: 4 bytes each
    # first bucket closes at >= 200 bytes (10 + 50 floats = 240 B), later ones at >= 1200 bytes
    assert assign_buckets(params, cap_bytes=1200, first_cap_bytes=200) == [[3, 2], [1], [0]]
    mixed = params[:2] + [nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    assert assign_buckets(mixed, cap_bytes=10**6, first_cap_bytes=10**6) == [[2], [1, 0]]  # one dtype per bucket


def test_buckets_start_during_backward_and_round_trip_gradients():
    events: list[str] = []
    net, rec = _net(), None
    rec = _Recorder(events)
    update = PostponedUpdate(net.parameters(), rec, bucket_cap_mb=0.5, first_bucket_mb=0.001)
    assert len(update.buckets) >= 3
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    net(_MarkInputGrad.apply(x, events)).sum().backward()
    # the last layers' buckets were sent before the backward pass reached the first layer's input
    assert events[0] == "start 0" and "backward reached the input" in events
    assert events.index("start 1") < events.index("backward reached the input")
    expected = [p.grad.clone() for p in net.parameters()]
    update.begin()
    assert len(rec.started) == len(update.buckets)
    for p in net.parameters():
        p.grad.mul_(0)  # the update writes the reduced gradients back
    assert update.apply(lambda: None)
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    assert not update.pending and not update.apply(lambda: None)


def test_bucket_order_kept_when_a_parameter_has_no_gradient():
    events: list[str] = []
    net = _net()
    rec = _Recorder(events)
    update = PostponedUpdate(net.parameters(), rec, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)  # 1 param each
    net[4].bias.requires_grad_(True)
    out = net[:4](torch.randn(3, 4, dtype=torch.float64)) @ net[4].weight.T  # last bias unused: bucket 0 never fills
    out.sum().backward()
    assert rec.started == []  # every later bucket waits for bucket 0
    update.begin()
    assert [e for e in events] == [f"start {i}" for i in range(len(update.buckets))]
    update.apply(lambda: None)
    assert net[4].bias.grad is None and net[4].weight.grad is not None


def test_accumulation_needs_no_sync():
    net = _net()
    update = PostponedUpdate(net.parameters(), _Recorder([]))
    x = torch.randn(4, 4, dtype=torch.float64)
    with update.no_sync():
        net(x).sum().backward()
    net(x).sum().backward()
    update.begin()
    update.apply(lambda: None)
    for p in net.parameters():  # the accumulated gradient (2x one micro-batch) went through the buckets
        g1 = torch.autograd.grad(net(x).sum(), p)[0]
        torch.testing.assert_close(p.grad, 2 * g1)
    net.zero_grad()
    net(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        net(x).sum().backward()  # a second micro-batch without no_sync after the buckets were sent
    update.close()
    net(x).sum().backward()  # hooks removed: no error, nothing sent

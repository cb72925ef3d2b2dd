"""A repeated split training step makes no host round trip the same step on whole tensors does not make: no value
read back to the host (``.item()``, ``float(t)``: on a GPU the host waits for the queue to drain) and no tensor
made from host data (``torch.tensor(list)``: on a GPU an upload from pageable memory, which waits alike).  Either,
once per layer and step, serialises the host's op dispatch with the device's kernels, which is what a GPU's
strong-scaling regime cannot afford.  The ATen calls are the same on every device, so they are counted on the
CPU, on two ranks with the sample split, for the layers whose tiled forms hold per-call data: aggregated batch,
group, instance and layer norm (the whole count), average pooling with partial windows (the divisors), adaptive
average pooling (the window bounds and sizes) and reflect padding (the remap's row indices)."""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hpc.distributed import run_in_processes

#: ATen calls that read a value back to the host, and that make a tensor from host data
READ_BACK = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item"})
UPLOAD = frozenset({"lift_fresh", "lift_fresh_copy"})


class _RoundTrips(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in READ_BACK or name in UPLOAD:
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(16, 8, 3, padding=1, padding_mode="reflect")
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = F.relu(self.bn(self.c1(x)))
        b = F.avg_pool2d(self.gn(a), 3, stride=2, padding=1, count_include_pad=False)
        b = F.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)
        c = self.inorm(self.c2(torch.cat([a, b], 1)))
        pooled = F.adaptive_avg_pool2d(c, (3, 5))
        return self.head(F.layer_norm(c, c.shape[1:])), pooled


def _round_trips(rank: int, world: int) -> tuple[dict[str, int], dict[str, int], float]:
    from lightning_hpc.spatial.dispatch import split_tensor
    from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
    from tests.spatial.spatial_checks import tile_of

    torch.manual_seed(0)
    grid = create_hybrid_layout((2, 1)).grid
    x, y = torch.randn(2, 3, 24, 16), torch.randint(0, 2, (2, 24, 16))
    nets = {split: _Net() for split in (True, False)}
    nets[False].load_state_dict(nets[True].state_dict())
    opts = {split: torch.optim.SGD(net.parameters(), lr=0.1) for split, net in nets.items()}

    def step(split: bool) -> None:
        xs = split_tensor(tile_of(x, grid), grid, x.shape) if split else x
        ys = split_tensor(tile_of(y, grid), grid, y.shape) if split else y
        opts[split].zero_grad()
        logits, pooled = nets[split](xs)
        (F.cross_entropy(logits, ys) + pooled.square().mean()).backward()
        if split:  # the parameters' gradients are this tile's part: summed over the tiles, as the strategy does
            for p in nets[split].parameters():
                if id(p) in grid.tile_params:
                    dist.all_reduce(p.grad, group=grid.group)
        opts[split].step()

    counted = {}
    for split in (True, False):
        for _ in range(2):  # the first calls make and cache what the later ones replay
            step(split)
        mode = _RoundTrips()
        with mode:
            step(split)
        counted[split] = dict(mode.seen)
    # the split run trained the same network as the whole one (so the counted steps computed the same thing)
    err = max(float((a - b).abs().max()) for a, b in zip(nets[True].parameters(), nets[False].parameters()))
    return counted[True], counted[False], err


def test_a_repeated_split_step_makes_no_host_round_trip_of_its_own():
    for rank, (split, whole, err) in enumerate(run_in_processes(_round_trips, 2)):
        assert split == whole, f"rank {rank}: split step {split}, the step on whole tensors {whole}"
        assert err < 1e-5, f"rank {rank}: the split network drifted from the whole one by {err}"

"""Batch norm (aggregated, incl. running statistics), upsampling, global pooling head, redistribution and the
adjoint (dot-product) test of the halo exchange, against the serial computation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from spatial_checks import TOL, compare_layer, max_err, tile_of
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.batchnorm import SpatialBatchNorm2d
from lightning_hpc.spatial.conv import SpatialConv2d
from lightning_hpc.spatial.halo_exchange import PartitionError, halo_exchange
from lightning_hpc.spatial.heads import SpatialGlobalAvgPool2d
from lightning_hpc.spatial.tiling import create_hybrid_layout
from lightning_hpc.spatial.upsample import SpatialUpsample


def _ops(rank: int, world: int, parts_list) -> list[str]:
    torch.manual_seed(0)
    fails: list[str] = []

    def check(what, errs):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        if bad:
            fails.append(f"rank {rank} {what}: {bad}")

    for parts in parts_list:
        layout = create_hybrid_layout(parts)
        grid = layout.grid
        x = torch.randn(3, 4, 13, 11, generator=torch.Generator().manual_seed(7 + layout.sample_index)) * 2 + 0.5

        # aggregated batch norm: outputs, grads, and running statistics over 3 steps (momentum and cumulative)
        for momentum in (0.1, None):
            bn = nn.BatchNorm2d(4, momentum=momentum)
            nn.init.normal_(bn.weight)
            nn.init.normal_(bn.bias)
            ref, sp = bn, SpatialBatchNorm2d.from_module(__import__("copy").deepcopy(bn), grid)
            for step in range(3):
                xs = x * (step + 1)
                check(
                    f"{parts} bn momentum={momentum} step {step}",
                    compare_layer(ref, lambda m: SpatialBatchNorm2d.from_module(m, grid), xs, grid, seed=step),
                )
                with torch.no_grad():
                    ref(xs)  # compare_layer worked on copies: advance the reference and the spatial layer once
                    sp(tile_of(xs, grid))
            check(f"{parts} bn running stats", {
                "mean": max_err(sp.running_mean, ref.running_mean),
                "var": max_err(sp.running_var, ref.running_var),
                "count": float(int(sp.num_batches_tracked) != int(ref.num_batches_tracked)),
            })
            sp.eval(), ref.eval()
            check(f"{parts} bn eval", {"out": max_err(sp(tile_of(x, grid)), tile_of(ref(x), grid))})

        # upsampling for segmentation heads
        for kw in (dict(scale_factor=2, mode="nearest"), dict(scale_factor=2, mode="bilinear"),
                   dict(scale_factor=4, mode="bilinear"), dict(size=(29, 23), mode="bilinear", align_corners=True),
                   dict(scale_factor=3, mode="nearest")):
            check(
                f"{parts} upsample {kw}",
                compare_layer(nn.Upsample(**kw), lambda m: SpatialUpsample.from_module(m, grid), x, grid),
            )

        # global average pool + Linear head: replicated output, head grads complete, conv grads summed
        head = nn.Sequential(
            nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)
        )

        def make_head(m):
            m[0] = SpatialConv2d.from_module(m[0], grid)
            m[2] = SpatialGlobalAvgPool2d.from_module(m[2], grid)
            return m

        ref = __import__("copy").deepcopy(head)
        sp = make_head(__import__("copy").deepcopy(head))
        xr = x.clone().requires_grad_(True)
        xt = tile_of(x, grid).clone().requires_grad_(True)
        yr, yt = ref(xr), sp(xt)
        g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3))
        (yr * g).sum().backward()
        (yt * g).sum().backward()
        errs = {"out": max_err(yt, yr), "dx": max_err(xt.grad, tile_of(xr.grad, grid))}
        for (n, pr), (_, ps) in zip(ref.named_parameters(), sp.named_parameters()):
            gs = ps.grad.clone()
            if n.startswith("0.") and grid.group is not None:
                dist.all_reduce(gs, group=grid.group)  # tile parameter: partial sums
            errs["d" + n] = max_err(gs, pr.grad)
        check(f"{parts} gap head", errs)

        # adjoint (dot-product) test of the halo exchange: <E x, y> = <x, E^T y>, summed over the group
        for k, s, p, d in ((3, 1, 1, 1), (7, 2, 3, 1), (3, 2, 1, 1), (5, 1, 4, 2)):
            conv = nn.Conv2d(1, 1, k, stride=s, padding=p, dilation=d)
            try:
                plan = SpatialConv2d.from_module(conv, grid).halo_plan(13, 11)
            except PartitionError:  # e.g. 13 rows over 4 tiles cannot feed a dilated 5x5 halo; same on every rank
                continue
            xt = tile_of(torch.randn(2, 3, 13, 11, generator=torch.Generator().manual_seed(5)), grid).clone()
            xt = xt.to(torch.float64).requires_grad_(True)
            ext = halo_exchange(xt, plan)
            y = torch.randn(ext.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))
            (ext * y).sum().backward()
            dots = torch.tensor(
                [(ext.detach() * y).sum().item(), (xt.detach() * xt.grad).sum().item()], dtype=torch.float64
            )
            dist.all_reduce(dots, group=grid.group)
            check(
                f"{parts} halo adjoint k{k} s{s} p{p} d{d}",
                {"adjoint": abs(float(dots[0] - dots[1])) / max(1.0, abs(float(dots[0])))},
            )
            if not abs(float(dots[0] - dots[1])) <= 1e-10 * max(1.0, abs(float(dots[0]))):
                fails.append(f"rank {rank} {parts} halo adjoint k{k}: {dots.tolist()}")
    return fails


@pytest.mark.parametrize(
    "world,parts_list",
    [(2, [(2, 1), (1, 2)]), (4, [(2, 2)]), pytest.param(4, [(4, 1), (2, 1)], marks=pytest.mark.slow)],
)
def test_ops_match_serial(world, parts_list):
    results = run_in_processes(_ops, world, parts_list, timeout_s=300, collective_timeout_s=120)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)

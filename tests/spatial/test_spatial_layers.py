"""Spatial layers vs the serial layers: output, input gradient and weight gradient at fp32 1e-5.

Each spawned process group runs the whole matrix (many layer configurations x partitions) so the default
suite stays within a few minutes on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch
from spatial_checks import TOL, compare_layer
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.conv import SpatialConv2d, tile_conv_applies
from lightning_hpc.spatial.pooling import SpatialAvgPool2d, SpatialMaxPool2d
from lightning_hpc.spatial.tiling import create_hybrid_layout

# (kernel, stride, padding, dilation)
CONV_CONFIGS = [
    (3, 1, 1, 1),
    (3, 2, 1, 1),
    (1, 2, 0, 1),
    (7, 2, 3, 1),
    (1, 1, 0, 1),
    (3, 1, 2, 2),
    (5, 1, 2, 1),
    (3, 1, 0, 1),
    (2, 2, 0, 1),
    (4, 2, 1, 1),
    ((3, 5), (2, 1), (1, 2), (1, 1)),
]
POOL_CONFIGS = [  # (kind, kernel, stride, padding, count_include_pad)
    ("max", 3, 2, 1, True),
    ("max", 2, 2, 0, True),
    ("max", 3, 1, 1, True),
    ("avg", 3, 2, 1, True),
    ("avg", 3, 2, 1, False),
    ("avg", 2, 2, 0, True),
    ("avg", 3, 1, 1, False),
]


def _layer_matrix(rank: int, world: int, parts_list, shape) -> list[str]:
    torch.manual_seed(0)
    failures = []
    for parts in parts_list:
        layout = create_hybrid_layout(parts)
        grid = layout.grid
        n, c, h, w = shape
        # every sample group gets different samples (hybrid sample x spatial)
        x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(100 + layout.sample_index))
        for idx, (k, s, p, d) in enumerate(CONV_CONFIGS):
            for overlap in (True, False):
                conv = nn.Conv2d(c, 5, k, stride=s, padding=p, dilation=d, bias=True)
                torch.nn.init.normal_(conv.weight, std=0.3)
                errs = compare_layer(
                    conv, lambda m: SpatialConv2d.from_module(m, grid, overlap=overlap), x, grid, seed=idx
                )
                bad = {key: v for key, v in errs.items() if not v <= TOL}
                if bad:
                    failures.append(f"rank {rank} parts {parts} conv k{k} s{s} p{p} d{d} overlap={overlap}: {bad}")
        for idx, (kind, k, s, p, cip) in enumerate(POOL_CONFIGS):
            if kind == "max":
                pool, make = nn.MaxPool2d(k, s, p), (lambda m: SpatialMaxPool2d.from_module(m, grid))
            else:
                pool, make = (
                    nn.AvgPool2d(k, s, p, count_include_pad=cip),
                    (lambda m: SpatialAvgPool2d.from_module(m, grid)),
                )
            errs = compare_layer(pool, make, x, grid, seed=100 + idx)
            bad = {key: v for key, v in errs.items() if not v <= TOL}
            if bad:
                failures.append(f"rank {rank} parts {parts} {kind}pool k{k} s{s} p{p} cip={cip}: {bad}")
    return failures


@pytest.mark.parametrize(
    "world,parts_list",
    [
        (2, [(2, 1), (1, 2)]),
        (4, [(2, 2)]),
        pytest.param(4, [(4, 1), (1, 4), (2, 1)], marks=pytest.mark.slow),  # (2, 1): 2 sample groups x 2 tiles
    ],
)
def test_conv_and_pool_match_serial(world, parts_list):
    # 19 x 17 does not divide by 2 or 4: uneven tiles everywhere
    results = run_in_processes(
        _layer_matrix, world, parts_list, (2, 3, 19, 17), timeout_s=300, collective_timeout_s=120
    )
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


# the in-place tile convolution (_TileConv2d: no box copy, edge rows recomputed) runs when every tile starts at
# a multiple of the stride and its output block is the native output of the tile; even extents give that
TILE_CONV_CONFIGS = [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (3, 1, 2, 2), (7, 2, 3, 1), (4, 2, 1, 1), (1, 2, 0, 1)]


def _tile_conv_matrix(rank: int, world: int, parts_list, shape) -> list[str]:
    torch.manual_seed(0)
    failures = []
    for parts in parts_list:
        grid = create_hybrid_layout(parts).grid
        n, c, h, w = shape
        x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(7))
        for idx, (k, s, p, d) in enumerate(TILE_CONV_CONFIGS):
            for overlap in (True, False):
                conv = nn.Conv2d(c, 5, k, stride=s, padding=p, dilation=d, bias=True)
                torch.nn.init.normal_(conv.weight, std=0.3)
                made = []
                errs = compare_layer(
                    conv,
                    lambda m: made.append(SpatialConv2d.from_module(m, grid, overlap=overlap)) or made[-1],
                    x,
                    grid,
                    seed=idx,
                )
                bad = {key: v for key, v in errs.items() if not v <= TOL}
                took = list(made[0]._edge_cache.values())
                if took != [] and any(r is None for r in took) or (took == [] and (k, s, p) != (1, 1, 0)):
                    bad["path"] = "box path taken, expected the in-place tile convolution"
                if not tile_conv_applies(conv, h, w, parts):  # the planner's prediction of the path (no box copies)
                    bad["planner"] = "tile_conv_applies says box path, the layer took the in-place path"
                if bad:
                    failures.append(f"rank {rank} parts {parts} conv k{k} s{s} p{p} d{d} overlap={overlap}: {bad}")
    return failures


@pytest.mark.parametrize("world,parts_list", [(2, [(2, 1), (1, 2)]), (4, [(2, 2)])])
def test_tile_conv_without_box_matches_serial(world, parts_list):
    results = run_in_processes(
        _tile_conv_matrix, world, parts_list, (2, 3, 24, 20), timeout_s=300, collective_timeout_s=120
    )
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


def test_tile_conv_applies_only_on_stride_aligned_tiles():
    conv = nn.Conv2d(1, 1, 3, stride=2, padding=1)
    assert tile_conv_applies(conv, 16, 16, (2, 1)) and tile_conv_applies(conv, 16, 16, (2, 2))
    assert not tile_conv_applies(conv, 18, 16, (2, 1))  # the second tile starts at row 9, not a stride multiple
    assert tile_conv_applies(conv, 18, 16, (1, 2))

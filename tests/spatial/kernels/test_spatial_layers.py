"""Convolution and pooling layers on split activations (plain ``nn`` layers, their ops routed to the tile kernels by
the op dispatch) vs the serial layers: output, input gradient and weight gradient at fp32 1e-5.

Each spawned process group runs the whole matrix (many layer configurations x partitions) so the default
suite stays within a few minutes on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.kernels import convolution_windows, tile_convolution_applies
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import TOL, compare_layer, conv_paths


def tile_path_predicted(conv: nn.Conv2d, h: int, w: int, parts: tuple[int, ...]) -> bool:
    """The planner's prediction of the convolution kernel's path (no box copies) for an ``h x w`` input."""
    windows = convolution_windows(conv.weight.shape, conv.stride, conv.padding, conv.dilation)
    return tile_convolution_applies((h, w), parts, windows)

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
                grid.policy.overlap = overlap  # the strategy's setting, read by the convolution handler
                errs = compare_layer(conv, x, grid, seed=idx)
                bad = {key: v for key, v in errs.items() if not v <= TOL}
                if bad:
                    failures.append(f"rank {rank} parts {parts} conv k{k} s{s} p{p} d{d} overlap={overlap}: {bad}")
        for idx, (kind, k, s, p, cip) in enumerate(POOL_CONFIGS):
            pool = nn.MaxPool2d(k, s, p) if kind == "max" else nn.AvgPool2d(k, s, p, count_include_pad=cip)
            errs = compare_layer(pool, x, grid, seed=100 + idx)
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


# the in-place tile convolution (the kernel's _TileConv: no box copy, edge rows recomputed) runs when every tile
# starts at a multiple of the stride and its output block is the native output of the tile; even extents give that
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
                grid.policy.overlap = overlap
                with conv_paths() as took:
                    errs = compare_layer(conv, x, grid, seed=idx)
                bad = {key: v for key, v in errs.items() if not v <= TOL}
                # a 1-wide kernel without padding reads no halo on any tile (stride-aligned even tiles): the native
                # convolution with torch's own autograd, neither path
                no_halo = (k, p) == (1, 0)
                if took["box"] or (took["tile"] > 0) == no_halo:
                    bad["path"] = f"paths taken {took}, expected the in-place tile convolution"
                if not tile_path_predicted(conv, h, w, parts):  # the planner's prediction of the path (no box copies)
                    bad["planner"] = "tile_path_predicted says box path, the layer took the in-place path"
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


def test_conv_paths_counts_the_box_path():
    """Negative control of the path check: the second tile of 18 rows starts at row 9, off the stride grid, so it
    takes the box path, and the counter sees it."""
    results = run_in_processes(_box_path_taken, 2, timeout_s=120, collective_timeout_s=60)
    assert all(r["tile"] + r["box"] == 1 for r in results) and results[1]["box"] == 1, results


def _box_path_taken(rank: int, world: int) -> dict[str, int]:
    grid = create_hybrid_layout((2, 1)).grid
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    with conv_paths() as took:
        compare_layer(conv, torch.randn(1, 3, 18, 16, generator=torch.Generator().manual_seed(1)), grid)
    return dict(took)


def test_tile_path_predicted_only_on_stride_aligned_tiles():
    conv = nn.Conv2d(1, 1, 3, stride=2, padding=1)
    assert tile_path_predicted(conv, 16, 16, (2, 1)) and tile_path_predicted(conv, 16, 16, (2, 2))
    assert not tile_path_predicted(conv, 18, 16, (2, 1))  # the second tile starts at row 9, not a stride multiple
    assert tile_path_predicted(conv, 18, 16, (1, 2))

"""Batch norm (aggregated, incl. running statistics), upsampling and a global pooling head on split activations
(plain ``nn`` layers through the op dispatch), against the serial computation.  The adjoint (dot-product) test of
the halo exchange is tests/spatial/kernels/test_kernels_exchange.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import on_unsupported, split_tensor
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import TOL, compare_layer, max_err, tile_of


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

        def split(t):
            return split_tensor(tile_of(t, grid), grid, t.shape)

        with on_unsupported("error"):  # every op here has a tiled form: a gather would be a defect
            # aggregated batch norm: outputs, grads, and running statistics over 3 steps (momentum and cumulative)
            for momentum in (0.1, None):
                bn = nn.BatchNorm2d(4, momentum=momentum)
                nn.init.normal_(bn.weight)
                nn.init.normal_(bn.bias)
                ref, sp = bn, copy.deepcopy(bn)
                for step in range(3):
                    xs = x * (step + 1)
                    check(f"{parts} bn momentum={momentum} step {step}", compare_layer(ref, xs, grid, seed=step))
                    with torch.no_grad():
                        ref(xs)  # compare_layer worked on copies: advance the reference and the split layer once
                        sp(split(xs))
                check(f"{parts} bn running stats", {
                    "mean": max_err(sp.running_mean, ref.running_mean),
                    "var": max_err(sp.running_var, ref.running_var),
                    "count": float(int(sp.num_batches_tracked) != int(ref.num_batches_tracked)),
                })
                sp.eval(), ref.eval()
                check(f"{parts} bn eval", {"out": max_err(sp(split(x)).local(), tile_of(ref(x), grid))})

            # upsampling for segmentation heads
            for kw in (dict(scale_factor=2, mode="nearest"), dict(scale_factor=2, mode="bilinear"),
                       dict(scale_factor=4, mode="bilinear"), dict(size=(29, 23), mode="bilinear", align_corners=True),
                       dict(scale_factor=3, mode="nearest")):
                check(f"{parts} upsample {kw}", compare_layer(nn.Upsample(**kw), x, grid))

            # global average pool + Linear head: replicated output, head grads complete, conv grads summed
            head = nn.Sequential(
                nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)
            )
            check(f"{parts} gap head", compare_layer(head, x, grid, seed=3))
    return fails


@pytest.mark.parametrize(
    "world,parts_list",
    [(2, [(2, 1), (1, 2)]), (4, [(2, 2)]), pytest.param(4, [(4, 1), (2, 1)], marks=pytest.mark.slow)],
)
def test_ops_match_serial(world, parts_list):
    results = run_in_processes(_ops, world, parts_list, timeout_s=300, collective_timeout_s=120)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


def test_one_tile_reductions_over_laid_out_dimensions_are_plain_and_not_gathered():
    """On a grid of one tile (1x1x1: the baseline of the volume benchmarks) a sum over the volume's dimensions
    is the serial result, plain, with nothing gathered (it used to keep a layout naming the removed dimensions and
    gather the next reduction)."""
    from lightning_hpc.spatial.dispatch import state
    from lightning_hpc.spatial.layout.tiling import SpatialGrid

    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64)
    xs = split_tensor(x, SpatialGrid.single(3), x.shape)
    before = state().gathers
    with on_unsupported("error"):
        per_class = xs.sum((2, 3, 4))
        total = per_class.mean()
    assert type(per_class) is torch.Tensor and torch.equal(per_class, x.sum((2, 3, 4)))
    assert torch.equal(total, x.sum((2, 3, 4)).mean()) and state().gathers == before

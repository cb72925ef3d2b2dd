"""Transposed convolution on split activations (halo exchange of the input rows each output tile reads) against
the serial op: outputs, input gradients and group-summed parameter gradients at 2x1 and 1x2 with uneven tiles,
in float32 and float64; nothing may be gathered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import on_unsupported, split_tensor, state
from lightning_hpc.spatial.kernels import transposed
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import max_err, tile_of

CONFIGS = [
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    dict(kernel_size=4, stride=2, padding=1),
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=3, stride=2, dilation=2, padding=2),
    dict(kernel_size=3, stride=2, padding=1, groups=2),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), bias=False),
    dict(kernel_size=5, stride=3, padding=2, output_padding=2),
]
TOLS = {torch.float32: 1e-5, torch.float64: 1e-11}


def _convt(rank: int, world: int, dtypes, sabotage: bool = False, parts_list=((2, 1), (1, 2))) -> list[str]:
    if sabotage:  # what the check must catch: no halo (each tile alone, zeros at every seam)
        def no_halo(x, plan):
            (r0, r1), (c0, c1) = plan.need
            (a, b), (c, e) = plan.own
            return F.pad(x, (c - c0, c1 - e, a - r0, r1 - b))  # the needed box, zeros (or cropped) at the seams

        transposed.halo_exchange = no_halo  # the tile kernel the op dispatch runs
    fails: list[str] = []
    for parts in parts_list:
        grid = create_hybrid_layout(parts).grid
        for dtype in dtypes:
            for k, cfg in enumerate(CONFIGS):
                torch.manual_seed(k)
                ref = nn.ConvTranspose2d(4, 6, **cfg).to(dtype)
                sp = nn.ConvTranspose2d(4, 6, **cfg).to(dtype)
                sp.load_state_dict(ref.state_dict())
                x = torch.randn(2, 4, 7, 5, generator=torch.Generator().manual_seed(k), dtype=dtype)
                xr = x.clone().requires_grad_(True)
                yr = ref(xr)
                g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(50 + k), dtype=dtype)
                (yr * g).sum().backward()
                xt = tile_of(x, grid).clone().requires_grad_(True)
                with on_unsupported("error"):
                    ys = sp(split_tensor(xt, grid, x.shape))
                    (ys * g).sum().backward()
                errs = {"out": max_err(ys.full(), yr), "dx": max_err(xt.grad, tile_of(xr.grad, grid))}
                for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
                    gs = ps.grad.clone()
                    dist.all_reduce(gs, group=grid.group)
                    errs[f"d{name}"] = max_err(gs, pr.grad)
                bad = {n: v for n, v in errs.items() if not v <= TOLS[dtype]}
                if tuple(ys.shape) != tuple(yr.shape):
                    bad["shape"] = (tuple(ys.shape), tuple(yr.shape))
                if bad:
                    fails.append(f"{cfg} {parts} {dtype}: {bad}")
    assert state().gathers == 0
    return fails


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_conv_transpose_equals_serial(dtype):
    for fails in run_in_processes(_convt, 2, [dtype], timeout_s=300):
        assert not fails, "\n".join(fails)


def test_conv_transpose_equals_serial_2x2():
    """4 ranks, uneven tiles in both dimensions, corner halos (float64)."""
    for fails in run_in_processes(_convt, 4, [torch.float64], False, [(2, 2)], timeout_s=600, collective_timeout_s=300):
        assert not fails, "\n".join(fails)


def test_conv_transpose_check_detects_missing_halo():
    for fails in run_in_processes(_convt, 2, [torch.float64], True, timeout_s=300):
        assert len(fails) >= len(CONFIGS), fails


def _bf16(rank: int, world: int) -> list[str]:
    """bf16 autocast: the tiled result has the serial op's dtype and is close to it; backward runs."""
    fails: list[str] = []
    grid = create_hybrid_layout((2, 1)).grid
    torch.manual_seed(0)
    ref = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)
    x = torch.randn(2, 4, 7, 5, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16), on_unsupported("error"):
        yr = ref(x)
        xt = tile_of(x, grid).clone().requires_grad_(True)
        ys = ref(split_tensor(xt, grid, x.shape))
        ys.float().sum().backward()
    if ys.dtype != yr.dtype:
        fails.append(f"dtype {ys.dtype} != serial {yr.dtype}")
    err = max_err(ys.full().float(), yr.float())
    if not err <= 2e-2 or xt.grad is None or not torch.isfinite(xt.grad).all() or ref.weight.grad is None:
        fails.append(f"bf16 error {err}")
    return fails


def test_conv_transpose_bf16_autocast():
    for fails in run_in_processes(_bf16, 2, timeout_s=300):
        assert not fails, "\n".join(fails)

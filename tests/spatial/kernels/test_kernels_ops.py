"""The N-d tile kernels (lightning_hpc.spatial.kernels) against the serial torch ops in float64 (1e-12): output
tile, input-gradient tile and group-summed weight and bias gradients, on 1-, 2- and 3-D splits with uneven
extents.  One launch per process count runs every grid and case (launches are the slow part)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial import kernels as K
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices

#: in the torch-range subset, run on the oldest and newest torch release (bash scripts/dev.sh torch-range)
pytestmark = pytest.mark.torch_range

TOL = 1e-12
EXTENTS = {1: (13,), 2: (9, 13), 3: (6, 9, 7)}
GRIDS_2 = [(2,), (2, 1), (1, 2), (2, 1, 1), (1, 1, 2), (1, 2, 1)]
GRIDS_4 = [(2, 2), (2, 2, 1), (1, 2, 2)]


def _tile(t: torch.Tensor, grid) -> torch.Tensor:
    k = grid.ndim
    return t[(..., *tile_slices(t.shape[-k:], grid.parts, grid.index))]


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if b is None:  # the serial op has no gradient there (an index output): nor may the tiled one
        return 0.0 if a is None or not a.abs().any() else float("inf")
    if a is None:
        a = torch.zeros_like(b)
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def compare(name: str, serial: Callable[..., torch.Tensor], tiled: Callable[..., torch.Tensor], x: torch.Tensor,
            params: list[torch.Tensor], grid, *, replicated: bool = False, seed: int = 0) -> list[str]:
    """Run ``serial(x, *params)`` on the whole input and ``tiled(tile, *params)`` on this rank's tile; the
    failures (errors above TOL) as text."""
    xr = x.clone().requires_grad_(True)
    pr = [p.clone().requires_grad_(True) for p in params]
    y = serial(xr, *pr)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1000), dtype=y.dtype)
    (y * g).sum().backward()
    xt = _tile(x, grid).clone().requires_grad_(True)
    pt = [p.clone().requires_grad_(True) for p in params]
    try:
        yt = tiled(xt, *pt)
        (yt * (g if replicated else _tile(g, grid))).sum().backward()
    except Exception as e:  # noqa: BLE001 - reported with the case that raised it
        return [f"{name} on {grid.parts}: {type(e).__name__}: {e}"]
    errs = {"out": _err(yt, y if replicated else _tile(y.detach(), grid)), "dx": _err(xt.grad, _tile(xr.grad, grid))}
    for e, (a, b) in enumerate(zip(pt, pr)):
        ga = torch.zeros_like(a) if a.grad is None else a.grad.clone()
        if grid.group is not None:
            dist.all_reduce(ga, group=grid.group)
        errs[f"dp{e}"] = _err(ga, b.grad)
    bad = {key: v for key, v in errs.items() if not v <= TOL}
    return [f"{name} on {grid.parts}: {bad}"] if bad else []


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- convolution ---------------------------------------------------------------------------------------------
CONV_CASES: list[dict[str, Any]] = [
    dict(kernel=3, padding=1),
    dict(kernel=3, padding=1, stride=2),
    dict(kernel=5, padding=2, dilation=1, groups=2),
    dict(kernel=3, padding=2, dilation=2),
    dict(kernel=3, padding="valid"),
    dict(kernel=4, padding="same"),
    dict(kernel=2, padding="same", dilation=3),
    dict(kernel=3, padding=0, stride=3, bias=False),
    dict(kernel=1, stride=2),
    dict(kernel=1),
    dict(kernel=4, padding=1, stride=2, groups=2),
]


def conv_cases(grid, seed: int) -> list[str]:
    k = grid.ndim
    ext = EXTENTS[k]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[k]
    fails: list[str] = []
    for c, case in enumerate(CONV_CASES):
        case = dict(case)
        ks, groups, bias = case.pop("kernel"), case.pop("groups", 1), case.pop("bias", True)
        x = _rand(2, 4, *ext, seed=seed + c)
        params = [_rand(6, 4 // groups, *(ks,) * k, seed=seed + 50 + c)] + ([_rand(6, seed=seed + 90 + c)] if bias
                                                                             else [])

        def serial(x, w, b=None, case=case, groups=groups):
            return conv(x, w, b, groups=groups, **case)

        for path in ("auto", "box"):
            def tiled(x, w, b=None, case=case, groups=groups, path=path):
                return K.conv(x, w, b, grid, ext, groups=groups, path=path, **case)

            fails += compare(f"conv{k}d {case} k={ks} g={groups} {path}", serial, tiled, x, params, grid, seed=c)
    return fails


EVEN_EXTENTS = {1: (16,), 2: (8, 12), 3: (4, 8, 8)}
TILE_CASES: list[dict[str, Any]] = [dict(padding=1), dict(padding=1, stride=2), dict(padding=2, dilation=2)]


def conv_path_cases(grid, seed: int) -> list[str]:
    """The in-place tile path forced (even extents, stride-aligned tiles) with and without overlap; the K-FAC
    hook's box; bf16 autocast against the serial op under autocast."""
    k = grid.ndim
    ext = EVEN_EXTENTS[k]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[k]
    fails: list[str] = []
    for c, case in enumerate(TILE_CASES):
        x = _rand(2, 3, *ext, seed=seed + c)
        params = [_rand(4, 3, *(3,) * k, seed=seed + 20 + c), _rand(4, seed=seed + 30 + c)]
        wins = K.convolution_windows(params[0].shape, **case)
        if not K.tile_convolution_applies(ext, grid.parts, wins):
            fails.append(f"conv{k}d {case} on {grid.parts}: the tile path should apply to {ext}")
            continue
        for overlap in (False, True):
            fails += compare(f"conv{k}d tile path {case} overlap={overlap}",
                             lambda x, w, b, case=case: conv(x, w, b, **case),
                             lambda x, w, b, case=case, o=overlap: K.conv(x, w, b, grid, ext, path="tile",
                                                                                 overlap=o, **case),
                             x, params, grid, seed=c)
        # K-FAC: the recorded box, convolved with padding 0, gives exactly this tile's outputs
        got: list[Any] = []
        xt = _tile(x, grid)
        y = K.conv(xt, *params, grid, ext, record=lambda box, extents: got.append((box, extents)), **case)
        box, extents = got[0]
        again = conv(box, *params, stride=case.get("stride", 1), dilation=case.get("dilation", 1))
        if _err(again, y) > TOL or extents != tuple(conv(x, *params, **case).shape[-k:]):
            fails.append(f"conv{k}d record {case} on {grid.parts}: box gives {_err(again, y)}, extents {extents}")
    # bf16 autocast: the operands cast as autocast casts a convolution's, so the serial op's dtype and values
    x = _rand(2, 3, *ext, seed=seed).float()
    w, b = _rand(4, 3, *(3,) * k, seed=seed + 1).float(), _rand(4, seed=seed + 2).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = conv(x, w, b, padding=1)
        for path in ("tile", "box"):
            out = K.conv(_tile(x, grid), w, b, grid, ext, padding=1, path=path)
            if out.dtype != ref.dtype or _err(out.float(), _tile(ref, grid).float()) > 2e-2:
                fails.append(f"conv{k}d bf16 autocast {path} on {grid.parts}: {out.dtype} vs {ref.dtype}")
    return fails


# -- max / average pooling -----------------------------------------------------------------------------------
POOL_CASES: list[dict[str, Any]] = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=2),
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=2, stride=2, ceil_mode=True),
    # odd extents: ceil mode's last window would start in the right padding, which torch drops
    dict(kernel_size=2, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, dilation=2),
    dict(kernel_size=3, stride=1, padding=1, divisor_override=4),
]


def pool_cases(grid, seed: int) -> list[str]:
    k = grid.ndim
    ext = EXTENTS[k]
    fails: list[str] = []
    for c, case in enumerate(POOL_CASES):
        x = _rand(2, 3, *ext, seed=seed + c)
        for kind in ("max", "avg"):
            args = dict(case)
            if kind == "max":
                if "count_include_pad" in args or "divisor_override" in args:
                    continue
                serial_op: Callable[..., torch.Tensor] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[k]
                tile_op: Callable[..., torch.Tensor] = K.max_pool
            else:
                if "dilation" in args or ("divisor_override" in args and k == 1):
                    continue  # no dilated average pooling in torch; F.avg_pool1d has no divisor_override
                serial_op, tile_op = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[k], K.avg_pool

            def serial(x, args=args, op=serial_op):
                return op(x, **args)

            def tiled(x, args=args, op=tile_op):
                return op(x, grid, ext, **args)

            fails += compare(f"{kind}_pool{k}d {args}", serial, tiled, x, [], grid, seed=c)
            if kind == "max" and args.get("padding"):
                # every entry negative: a window's maximum is never the border's padding (torch skips it)
                fails += compare(f"{kind}_pool{k}d {args} negative", serial, tiled, -x.abs() - 1, [], grid, seed=c)
    return fails


# -- transposed convolution ----------------------------------------------------------------------------------
CONVT_CASES: list[dict[str, Any]] = [
    dict(kernel=2, stride=2),
    dict(kernel=3, stride=2, padding=1, output_padding=1),
    dict(kernel=4, stride=2, padding=1, groups=2),
    dict(kernel=3, stride=1, padding=1),
    dict(kernel=3, stride=2, dilation=2, padding=2, bias=False),
    dict(kernel=5, stride=3, padding=2, output_padding=2),
    dict(kernel=1, stride=3, output_padding=1),  # outputs in stride gaps: the bias alone
]


def convt_cases(grid, seed: int) -> list[str]:
    k = grid.ndim
    ext = {1: (7,), 2: (5, 7), 3: (4, 5, 3)}[k]
    op = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[k]
    fails: list[str] = []
    for c, case in enumerate(CONVT_CASES):
        case = dict(case)
        ks, groups, bias = case.pop("kernel"), case.pop("groups", 1), case.pop("bias", True)
        x = _rand(2, 4, *ext, seed=seed + c)
        params = [_rand(4, 6 // groups, *(ks,) * k, seed=seed + 40 + c)] + ([_rand(6, seed=seed + 80 + c)] if bias
                                                                             else [])

        def serial(x, w, b=None, case=case, groups=groups):
            return op(x, w, b, groups=groups, **case)

        def tiled(x, w, b=None, case=case, groups=groups):
            return K.conv_transpose(x, w, b, grid, ext, groups=groups, **case)

        fails += compare(f"conv_transpose{k}d {case} k={ks} g={groups}", serial, tiled, x, params, grid, seed=c)
    return fails


# -- interpolation -------------------------------------------------------------------------------------------
def interp_cases(grid, seed: int) -> list[str]:
    k = grid.ndim
    ext = EXTENTS[k]
    linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[k]
    cases: list[dict[str, Any]] = [
        dict(scale_factor=2, mode="nearest"),
        dict(scale_factor=1.7, mode="nearest"),
        dict(size=tuple(n + 5 for n in ext), mode="nearest-exact"),
        dict(size=tuple(max(2, n // 2) for n in ext), mode="nearest"),
        dict(scale_factor=2, mode=linear, align_corners=False),
        dict(scale_factor=2, mode=linear, align_corners=True),
        dict(size=tuple(2 * n + 3 for n in ext), mode=linear, align_corners=False),
        dict(size=tuple(2 * n + 3 for n in ext), mode=linear, align_corners=True),
        dict(scale_factor=1.5, mode=linear, recompute_scale_factor=True),
        dict(scale_factor=0.75, mode=linear),
    ]
    fails: list[str] = []
    for c, case in enumerate(cases):
        x = _rand(2, 3, *ext, seed=seed + c)

        def serial(x, case=case):
            return F.interpolate(x, **case)

        def tiled(x, case=case):
            return K.interpolate(x, grid, ext, **case)

        fails += compare(f"interpolate {case}", serial, tiled, x, [], grid, seed=c)
    return fails


# -- adaptive pooling ----------------------------------------------------------------------------------------
def adaptive_cases(grid, seed: int) -> list[str]:
    k = grid.ndim
    ext = EXTENTS[k]
    avg = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[k]
    mx = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}[k]
    # None keeps the input's extent (2-D and 3-D ops only)
    sizes: list[Any] = [1, 3, tuple(n - 1 for n in ext), (None, *([2] * (k - 1))) if k > 1 else 5]
    fails: list[str] = []
    for c, size in enumerate(sizes):
        x = _rand(2, 3, *ext, seed=seed + c)
        fails += compare(f"adaptive_avg_pool{k}d {size}", lambda x, s=size: avg(x, s),
                         lambda x, s=size: K.adaptive_avg_pool(x, grid, ext, s), x, [], grid, replicated=True, seed=c)
        fails += compare(f"adaptive_max_pool{k}d {size}", lambda x, s=size: mx(x, s),
                         lambda x, s=size: K.adaptive_max_pool(x, grid, ext, s), x, [], grid, replicated=True, seed=c)
        # the serial op's indices, ties included: a coarse input has many equal maxima (some across tiles)
        xq = torch.round(x * 1.5)
        _, want = mx(xq, size, return_indices=True)
        _, got = K.adaptive_max_pool(_tile(xq, grid), grid, ext, size, return_indices=True)
        if not torch.equal(got, want):
            fails.append(f"adaptive_max_pool{k}d {size} on {grid.parts}: indices differ from the serial op's")
    return fails


def _worker(rank: int, world: int, grids: list[tuple[int, ...]], families: list[str]) -> list[str]:
    torch.set_num_threads(1)
    fails: list[str] = []
    for parts in grids:
        grid = create_hybrid_layout(parts).grid
        for fam in families:
            fails += FAMILIES[fam](grid, 7 * len(parts))
    return fails


FAMILIES: dict[str, Callable[[Any, int], list[str]]] = {
    "conv": conv_cases,
    "conv_paths": conv_path_cases,
    "pool": pool_cases,
    "convt": convt_cases,
    "interp": interp_cases,
    "adaptive": adaptive_cases,
}


@pytest.mark.parametrize("world,grids", [(2, GRIDS_2), (4, GRIDS_4)], ids=["2proc", "4proc"])
def test_kernels_equal_serial_ops(world: int, grids: list[tuple[int, ...]]) -> None:
    results = run_in_processes(_worker, world, grids, list(FAMILIES), timeout_s=600)
    fails = sorted({f for r in results for f in r})
    assert not fails, "\n".join(fails[:40])

"""Ops with exact tiled forms that used to be gathered: ``padding_mode`` reflect / replicate / circular (and
``F.pad`` with those modes), max/avg pooling with ``ceil_mode=True``, ``AdaptiveAvgPool2d(k > 1)``,
``PixelShuffle`` / ``PixelUnshuffle`` and ``Softmax2d``.  Each equals one process in output, input gradient and
(group-summed) parameter gradients at 2x1, 1x2 and 2x2 with uneven tiles, in float32 and float64, with
nothing gathered (``on_unsupported="error"``: a gather raises) and no spatial warning; a small CNN using them
trained through ``Trainer.fit`` equals one process after 3 steps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialTensor, on_unsupported, split_tensor, state
from lightning_hpc.spatial.layout import remap
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import max_err, tile_of

TOLS = {torch.float32: 1e-5, torch.float64: 1e-11}


class Fn(nn.Module):
    """A functional op as a module (so the cases below are one list)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _pad(pads, mode):
    return lambda x: F.pad(x, pads, mode=mode)


def _max_with_indices(x):
    """Adaptive max pooling of mostly-zero activations (ties in most windows) with its indices folded into the
    output, so an index that differs from the serial op's shows as a different output."""
    out, idx = F.adaptive_max_pool2d(F.relu(x - 1.5), (3, 5), return_indices=True)
    return out + idx.to(out.dtype) * 1e-3


def _cases():
    """(name, module, input extent (H, W), channels): uneven tiles over 2 parts (13, 11) and over 4 tiles."""
    cases = []
    for mode in ("reflect", "replicate", "circular"):
        cases += [
            (f"Conv2d(3, padding=1, padding_mode={mode})", nn.Conv2d(4, 5, 3, padding=1, padding_mode=mode),
             (13, 11), 4),
            (f"Conv2d(5, stride=2, padding=2, padding_mode={mode})",
             nn.Conv2d(4, 3, 5, stride=2, padding=2, padding_mode=mode), (13, 11), 4),
            # asymmetric padding wider than a tile (tiles of 3 to 7 rows): the mirrored rows come from other tiles
            (f"F.pad((5, 1, 2, 6), {mode})", Fn(_pad((5, 1, 2, 6), mode)), (13, 11), 4),
            (f"F.pad((0, 3, 0, 0), {mode})", Fn(_pad((0, 3, 0, 0), mode)), (13, 11), 4),
        ]
    cases += [
        ("ReflectionPad2d((1, 2, 3, 0))", nn.ReflectionPad2d((1, 2, 3, 0)), (13, 11), 4),
        ("ReplicationPad2d(2)", nn.ReplicationPad2d(2), (13, 11), 4),
        ("CircularPad2d(1)", nn.CircularPad2d(1), (13, 11), 4),
        ("MaxPool2d(2, ceil_mode)", nn.MaxPool2d(2, ceil_mode=True), (13, 11), 4),
        ("MaxPool2d(3, 2, 1, ceil_mode)", nn.MaxPool2d(3, 2, 1, ceil_mode=True), (13, 11), 4),
        ("MaxPool2d(3, 3, 1, dilation=2, ceil_mode)", nn.MaxPool2d(3, 3, 1, dilation=2, ceil_mode=True), (13, 11), 4),
        ("AvgPool2d(2, ceil_mode)", nn.AvgPool2d(2, ceil_mode=True), (13, 11), 4),
        ("AvgPool2d(3, 2, 1, ceil_mode)", nn.AvgPool2d(3, 2, 1, ceil_mode=True), (13, 11), 4),
        ("AvgPool2d(3, 2, 1, ceil_mode, count_include_pad=False)",
         nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (13, 11), 4),
        ("AvgPool2d(4, 3, 1, ceil_mode)", nn.AvgPool2d(4, 3, 1, ceil_mode=True), (13, 11), 4),
        ("AvgPool2d(3, 2, 1, count_include_pad=False)", nn.AvgPool2d(3, 2, 1, count_include_pad=False), (13, 11), 4),
        ("AdaptiveAvgPool2d(2)", nn.AdaptiveAvgPool2d(2), (13, 11), 4),
        ("AdaptiveAvgPool2d((3, 5))", nn.AdaptiveAvgPool2d((3, 5)), (13, 11), 4),
        ("AdaptiveAvgPool2d(6) after a conv", nn.Sequential(nn.Conv2d(4, 3, 3, padding=1), nn.AdaptiveAvgPool2d(6)),
         (13, 11), 4),
        ("AdaptiveMaxPool2d(2)", nn.AdaptiveMaxPool2d(2), (13, 11), 4),
        ("AdaptiveMaxPool2d(4) after a conv", nn.Sequential(nn.Conv2d(4, 3, 3, padding=1), nn.AdaptiveMaxPool2d(4)),
         (13, 11), 4),
        ("F.adaptive_max_pool2d((3, 5), return_indices) with ties", Fn(_max_with_indices), (13, 11), 4),
        ("PixelShuffle(2) after a conv", nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.PixelShuffle(2)), (13, 11), 4),
        ("PixelShuffle(3)", nn.PixelShuffle(3), (13, 11), 9),
        ("PixelUnshuffle(2)", nn.PixelUnshuffle(2), (14, 10), 4),
        ("PixelUnshuffle(3) then a conv", nn.Sequential(nn.PixelUnshuffle(3), nn.Conv2d(18, 4, 3, padding=1)),
         (18, 15), 2),
        ("Softmax2d", nn.Softmax2d(), (13, 11), 4),
        # constant padding and crops: tile boundaries shift, rows cross them (13 x 11 over 2 parts: 7 + 6, 6 + 5)
        ("F.pad((1, 2, 3, 0))", Fn(lambda x: F.pad(x, (1, 2, 3, 0))), (13, 11), 4),
        ("F.pad((2, 1, 1, 4), value=0.5)", Fn(lambda x: F.pad(x, (2, 1, 1, 4), value=0.5)), (13, 11), 4),
        ("ZeroPad2d((1, 2, 0, 3)) after a conv",
         nn.Sequential(nn.Conv2d(4, 3, 3, padding=1), nn.ZeroPad2d((1, 2, 0, 3))), (13, 11), 4),
        ("ConstantPad2d(2, -1.5)", nn.ConstantPad2d(2, -1.5), (13, 11), 4),
        ("F.pad((0, 0, 1, 1, 1, 0)) of C and H", Fn(lambda x: F.pad(x, (0, 0, 1, 1, 1, 0))), (13, 11), 4),
        ("F.pad((-1, -2, -3, 0)) crop", Fn(lambda x: F.pad(x, (-1, -2, -3, 0))), (13, 11), 4),
        ("F.pad((-4, 2, 1, -5)) crop and pad", Fn(lambda x: F.pad(x, (-4, 2, 1, -5))), (13, 11), 4),
        # crops wider than a tile: the first tile's rows all go, its share comes from the next tiles
        ("F.pad((0, -6, -8, 0)) crop past a tile", Fn(lambda x: F.pad(x, (0, -6, -8, 0))), (13, 11), 4),
        ("centre crop x[:, :, 3:10, 2:9] then a conv",
         nn.Sequential(Fn(lambda x: x[:, :, 3:10, 2:9]), nn.Conv2d(4, 3, 3, padding=1)), (13, 11), 4),
        ("x[..., 8:, :3] crop past a tile", Fn(lambda x: x[..., 8:, :3]), (13, 11), 4),
        ("x[..., ::2, 1::3]", Fn(lambda x: x[..., ::2, 1::3]), (13, 11), 4),
        ("narrow(2, 3, 7).narrow(-1, -9, 8)", Fn(lambda x: torch.narrow(x, 2, 3, 7).narrow(-1, -9, 8)), (13, 11), 4),
        ("torch.constant_pad_nd((1, 0, 2, -3), 0.25)", Fn(lambda x: torch.constant_pad_nd(x, (1, 0, 2, -3), 0.25)),
         (13, 11), 4),
    ]
    return cases


def _compare(ref: nn.Module, x: torch.Tensor, grid) -> dict[str, float]:
    """One forward/backward of ``ref`` on the whole ``x`` and of a copy of it on this rank's split tile."""
    sp = copy.deepcopy(ref)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(3), dtype=yr.dtype)
    (yr * g).sum().backward()
    xt = tile_of(x, grid).clone().requires_grad_(True)
    ys = sp(split_tensor(xt, grid, x.shape))
    (ys * g).sum().backward()
    out = ys.full() if isinstance(ys, SpatialTensor) else ys
    errs = {"out": max_err(out, yr) if out.shape == yr.shape else float("inf"),
            "dx": max_err(xt.grad, tile_of(xr.grad, grid))}
    for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
        gs = ps.grad.clone()
        dist.all_reduce(gs, group=grid.group)  # tile parts: the strategy sums them over the spatial group
        errs[f"d{name}"] = max_err(gs, pr.grad)
    return errs


def _ops(rank: int, world: int, parts_list, dtypes, sabotage: str = "") -> list[str]:
    if sabotage == "reflect_as_replicate":  # what the check must catch: a wrong border
        real = remap.pad_source
        remap.pad_source = lambda n, lo, hi, mode: real(n, lo, hi, "replicate" if mode == "reflect" else mode)
    if sabotage == "constant_pad_shifted":  # rows one place off
        real_constant = remap.constant_pad_source
        remap.constant_pad_source = lambda n, lo, hi: real_constant(n, lo + 1, hi - 1)
    fails: list[str] = []
    for parts in parts_list:
        grid = create_hybrid_layout(parts).grid
        for dtype in dtypes:
            tol = TOLS[dtype] * (5 if grid.size > 2 and dtype == torch.float32 else 1)
            torch.manual_seed(1)  # the same parameters on every rank
            for name, module, (h, w), c in _cases():
                ref = module.to(dtype)
                x = torch.randn(3, c, h, w, generator=torch.Generator().manual_seed(7), dtype=dtype)
                with on_unsupported("error"), warnings.catch_warnings(record=True) as caught:  # a gather would raise
                    warnings.simplefilter("always")
                    errs = _compare(ref, x, grid)
                spatial = [str(m.message) for m in caught if "spatial:" in str(m.message)]
                bad = {k: v for k, v in errs.items() if not v <= tol}
                if bad or spatial:
                    fails.append(f"{name} {parts} {dtype}: {bad} {spatial}")
    if state().gathers:
        fails.append(f"{state().gathers} gathers")
    return fails


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_tiled_ops_equal_serial(dtype):
    for fails in run_in_processes(_ops, 2, [(2, 1), (1, 2)], [dtype], timeout_s=300):
        assert not fails, "\n".join(fails)


def test_tiled_ops_equal_serial_2x2():
    """4 ranks, uneven tiles in both dimensions."""
    for fails in run_in_processes(_ops, 4, [(2, 2)], [torch.float32, torch.float64], timeout_s=600,
                                  collective_timeout_s=300):
        assert not fails, "\n".join(fails)


def test_check_detects_a_wrong_border():
    """The comparison above fails for every reflect case when reflect padding replicates instead."""
    for fails in run_in_processes(_ops, 2, [(2, 1)], [torch.float64], "reflect_as_replicate", timeout_s=300):
        reflect = [name for name, *_ in _cases() if "reflect" in name.lower()]
        for name in reflect:
            assert any(f.startswith(name + " ") for f in fails), f"{name} not caught: {fails}"
        assert all("reflect" in f.split(" (")[0].lower() for f in fails), fails


CONSTANT_PADS = ("F.pad((1", "F.pad((2", "ZeroPad2d", "ConstantPad2d", "F.pad((0, 0", "F.pad((-", "F.pad((0, -6",
                 "torch.constant_pad_nd")


def test_check_detects_a_shifted_constant_pad():
    """The comparison above fails for every constant padding and crop (all pad H, moved by the remap at 2x1) when
    the padded rows are one place off."""
    for fails in run_in_processes(_ops, 2, [(2, 1)], [torch.float64], "constant_pad_shifted", timeout_s=300):
        constant = [name for name, *_ in _cases() if name.startswith(CONSTANT_PADS)]
        assert len(constant) == 9, constant
        for name in constant:
            assert any(f.startswith(name + " ") for f in fails), f"{name} not caught: {fails}"


def _bf16(rank: int, world: int) -> list[str]:
    """Under bf16 autocast the tiled ops give the serial op's dtype and value (the adaptive average's sums stay in
    float32 as the serial kernel's do)."""
    fails: list[str] = []
    grid = create_hybrid_layout((2, 1)).grid
    torch.manual_seed(1)
    cases = {name: (m, hw, c) for name, m, hw, c in _cases()}
    for name in ("Conv2d(3, padding=1, padding_mode=reflect)", "AdaptiveAvgPool2d((3, 5))",
                 "AvgPool2d(3, 2, 1, ceil_mode)", "PixelShuffle(2) after a conv", "AdaptiveMaxPool2d(4) after a conv"):
        module, (h, w), c = cases[name]
        x = torch.randn(3, c, h, w, generator=torch.Generator().manual_seed(7))
        with torch.autocast("cpu", dtype=torch.bfloat16), on_unsupported("error"):
            yr = module(x)
            ys = copy.deepcopy(module)(split_tensor(tile_of(x, grid).clone(), grid, x.shape))
        ys = ys.full() if isinstance(ys, SpatialTensor) else ys
        tol = 1e-5 if yr.dtype == torch.float32 else 2e-2
        if ys.dtype != yr.dtype or not max_err(ys.float(), yr.float()) <= tol:
            fails.append(f"{name}: {ys.dtype} vs serial {yr.dtype}, error {max_err(ys.float(), yr.float())}")
    return fails


def test_tiled_ops_bf16_autocast():
    for fails in run_in_processes(_bf16, 2, timeout_s=300):
        assert not fails, "\n".join(fails)


# ------------------------------------------------------------------------------------------------------------
# through Trainer.fit: a user CNN with these ops equals one process, with nothing gathered
# ------------------------------------------------------------------------------------------------------------
class PadPoolShuffleNet(nn.Module):
    """Reflect-, circular- and replicate-padded convolutions, max and avg pooling with ceil_mode, PixelShuffle,
    and an AdaptiveAvgPool2d(2) + Flatten + Linear head (13 x 10 input: every pooling has a partial window)."""

    def __init__(self) -> None:
        from tests.spatial.lightning.test_split_equals_one_process import CLASSES, C

        super().__init__()
        self.stem = nn.Conv2d(C, 8, 3, padding=1, padding_mode="reflect")
        self.pool = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.mid = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.up = nn.PixelShuffle(2)
        self.post = nn.Conv2d(2, 4, 3, padding=1, padding_mode="replicate")
        self.down = nn.AvgPool2d(2, ceil_mode=True)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, CLASSES))

    def forward(self, x):
        f = self.pool(torch.relu(self.stem(x)))
        f = self.up(torch.relu(self.mid(f)))
        return self.head(self.down(torch.relu(self.post(f))))


class UNetPadCrop(nn.Module):
    """U-Net idioms on the odd 13 x 10 input: a transposed-convolution upsampling padded to the skip's size with
    ``F.pad``, a valid convolution, a skip centre-cropped by slicing and another by negative ``F.pad``, a
    ``ZeroPad2d``; the 12 x 9 output is smaller than the input (the loss crops the target by slicing)."""

    def __init__(self) -> None:
        from tests.spatial.lightning.test_split_equals_one_process import CLASSES, C

        super().__init__()
        self.inc = nn.Conv2d(C, 4, 3, padding=1)
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.fuse = nn.Conv2d(8, 4, 3)  # valid: 13 x 10 -> 11 x 8
        self.mix = nn.Conv2d(8, 4, 1)
        self.pad = nn.ZeroPad2d((1, 0, 0, 1))
        self.out = nn.Conv2d(8, CLASSES, 1)

    def forward(self, x):
        s = torch.relu(self.inc(x))  # 13 x 10
        u = torch.relu(self.up(self.down(s)))  # 12 x 10
        dy, dx = s.shape[2] - u.shape[2], s.shape[3] - u.shape[3]
        u = F.pad(u, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])  # pad to the skip's size
        f = torch.relu(self.fuse(torch.cat([s, u], 1)))  # 11 x 8
        top, left = (s.shape[2] - f.shape[2]) // 2, (s.shape[3] - f.shape[3]) // 2
        g = self.pad(torch.relu(self.mix(torch.cat([f, s[:, :, top:top + f.shape[2], left:left + f.shape[3]]], 1))))
        dy, dx = s.shape[2] - g.shape[2], s.shape[3] - g.shape[3]  # 12 x 9: crop the skip by negative padding
        c = F.pad(s, [-(dx // 2), -(dx - dx // 2), -(dy // 2), -(dy - dy // 2)])
        return self.out(torch.cat([g, c], 1))


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_trainer_fit_unet_pad_and_crop_equals_one_process(parts):
    """Nothing gathered, no spatial warning, loss, gradients, parameters and eval output of one process."""
    from tests.spatial.kernels.test_spatial_norms import _check_fit, _one_process_run, _split_run

    ref = _one_process_run(UNetPadCrop, "seg")
    for res in run_in_processes(_split_run, 2, parts, UNetPadCrop, "seg", timeout_s=300, collective_timeout_s=120):
        _check_fit(res, ref, f"{parts[0]}x{parts[1]}")


@pytest.mark.slow
def test_trainer_fit_unet_pad_and_crop_equals_one_process_2x2():
    from tests.spatial.kernels.test_spatial_norms import _check_fit, _one_process_run, _split_run

    ref = _one_process_run(UNetPadCrop, "seg")
    for res in run_in_processes(_split_run, 4, (2, 2), UNetPadCrop, "seg", timeout_s=900, collective_timeout_s=300):
        _check_fit(res, ref, "2x2", tol=5e-5)


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_trainer_fit_with_tiled_ops_equals_one_process(parts):
    from tests.spatial.kernels.test_spatial_norms import _check_fit, _one_process_run, _split_run

    ref = _one_process_run(PadPoolShuffleNet, "cls")
    for res in run_in_processes(_split_run, 2, parts, PadPoolShuffleNet, "cls", timeout_s=300,
                                collective_timeout_s=120):
        _check_fit(res, ref, f"{parts[0]}x{parts[1]}")


@pytest.mark.slow
def test_trainer_fit_with_tiled_ops_equals_one_process_2x2():
    from tests.spatial.kernels.test_spatial_norms import _check_fit, _one_process_run, _split_run

    ref = _one_process_run(PadPoolShuffleNet, "cls")
    for res in run_in_processes(_split_run, 4, (2, 2), PadPoolShuffleNet, "cls", timeout_s=900,
                                collective_timeout_s=300):
        _check_fit(res, ref, "2x2", tol=5e-5)

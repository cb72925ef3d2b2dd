"""Model and loss idioms of the common segmentation libraries computed on split activations with nothing gathered,
equal to one process (float64): written here as a user of those libraries writes them.

* an FPN decoder (as segmentation_models_pytorch's ``FPN``) merging its pyramid with ``torch.stack(...).sum(0)``
  (and with ``torch.cat`` along the channels), with ``Dropout2d``;
* a Dice loss as segmentation_models_pytorch's ``DiceLoss`` computes it: logits viewed ``(N, C, H*W)``, the label
  ``(N, H*W)`` one-hot encoded with ``F.one_hot`` and permuted, per-class sums over ``(0, 2)``, an ignored label;
* MONAI's ``one_hot`` (``torch.zeros(...).scatter_(1, label, 1)``) and ``DiceCELoss`` (softmax Dice over the
  spatial dimensions plus a cross entropy of ``target.squeeze(1)``), on images and volumes;
* ``F.dropout3d`` on volumes, ``F.dropout2d`` on signals ``(N, C, L)`` and volumes, ``F.dropout1d``.

Each runs on 2 processes at 2x1 and 1x2 (images), 1x1x2 (volumes) or 2 (signals) under
``on_unsupported("error")`` (a gather raises) with the gather counter checked, and its value and the input's
gradient equal one process's to 1e-12.  (The FPN's ``torch.cat`` merge was tiled before: kept beside the stack.)

And ``Trainer.fit`` of a 3-D U-Net with ``Dropout3d`` and the DiceCE + one_hot loss on sub-volumes split 1x1x2
(the volume tests' data), seeded once before the model is built: the losses and parameters of one process, and
nothing gathered in the whole fit.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import seed_everything
from test_dropout_seeding import DropoutUNet
from test_volumes import BATCH, SubVolumes
from test_volumes import N as N_VOLUMES
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialTensor, on_unsupported, split_tensor, state
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

TOL = 1e-12
FIT_TOL = 1e-9  # float64, after a few optimizer steps (as the volume tests)
N, CLASSES = 2, 3


# ---- segmentation_models_pytorch's FPN decoder, as its source writes it ------------------------------------------


class Conv3x3GNReLU(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, upsample: bool = False) -> None:
        super().__init__()
        self.upsample = upsample
        self.block = nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
                                   nn.GroupNorm(2, out_channels), nn.ReLU(inplace=True))

    def forward(self, x):
        x = self.block(x)
        if self.upsample:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
        return x


class FPNBlock(nn.Module):
    def __init__(self, pyramid_channels: int, skip_channels: int) -> None:
        super().__init__()
        self.skip_conv = nn.Conv2d(skip_channels, pyramid_channels, kernel_size=1)

    def forward(self, x, skip):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return x + self.skip_conv(skip)


class SegmentationBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, n_upsamples: int = 0) -> None:
        super().__init__()
        blocks = [Conv3x3GNReLU(in_channels, out_channels, upsample=bool(n_upsamples))]
        for _ in range(1, n_upsamples):
            blocks.append(Conv3x3GNReLU(out_channels, out_channels, upsample=True))
        self.block = nn.Sequential(*blocks)

    def forward(self, x):
        return self.block(x)


class MergeBlock(nn.Module):
    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, x):
        if self.policy == "add":
            return torch.stack(x).sum(dim=0)
        return torch.cat(x, dim=1)


class FPN(nn.Module):
    """An encoder of strided convolutions, the FPN decoder, a segmentation head upsampling to the input."""

    def __init__(self, merge_policy: str, pyramid: int = 4, seg: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU())
        self.down = nn.ModuleList([nn.Sequential(nn.Conv2d(c, c + 1, 3, stride=2, padding=1), nn.ReLU())
                                   for c in (3, 4, 5)])
        self.p5 = nn.Conv2d(6, pyramid, kernel_size=1)
        self.p4 = FPNBlock(pyramid, 5)
        self.p3 = FPNBlock(pyramid, 4)
        self.seg_blocks = nn.ModuleList([SegmentationBlock(pyramid, seg, n_upsamples=n) for n in (2, 1, 0)])
        self.merge = MergeBlock(merge_policy)
        self.dropout = nn.Dropout2d(p=0.3, inplace=True)
        out = seg if merge_policy == "add" else 3 * seg
        self.head = nn.Sequential(nn.Conv2d(out, CLASSES, 3, padding=1),
                                  nn.UpsamplingBilinear2d(scale_factor=2))

    def forward(self, x):
        features = [self.stem(x)]
        for d in self.down:
            features.append(d(features[-1]))
        c3, c4, c5 = features[-3:]
        p5 = self.p5(c5)
        p4 = self.p4(p5, c4)
        p3 = self.p3(p4, c3)
        pyramid = [block(p) for block, p in zip(self.seg_blocks, [p5, p4, p3])]
        return self.head(self.dropout(self.merge(pyramid)))


# ---- segmentation_models_pytorch's DiceLoss (multiclass, from logits), as its source writes it --------------------


def soft_dice_score(output, target, smooth=0.0, eps=1e-7, dims=None):
    assert output.size() == target.size()
    intersection = torch.sum(output * target, dim=dims)
    cardinality = torch.sum(output + target, dim=dims)
    return (2.0 * intersection + smooth) / (cardinality + smooth).clamp_min(eps)


class SmpDiceLoss(nn.Module):
    def __init__(self, ignore_index: int | None = None, smooth: float = 0.0, eps: float = 1e-7) -> None:
        super().__init__()
        self.ignore_index, self.smooth, self.eps = ignore_index, smooth, eps

    def forward(self, y_pred, y_true):
        assert y_true.size(0) == y_pred.size(0)
        y_pred = y_pred.log_softmax(dim=1).exp()
        bs = y_true.size(0)
        num_classes = y_pred.size(1)
        dims = (0, 2)
        y_true = y_true.view(bs, -1)
        y_pred = y_pred.view(bs, num_classes, -1)
        if self.ignore_index is not None:
            mask = y_true != self.ignore_index
            y_pred = y_pred * mask.unsqueeze(1)
            y_true = F.one_hot((y_true * mask).to(torch.long), num_classes)  # N,H*W -> N,H*W, C
            y_true = y_true.permute(0, 2, 1) * mask.unsqueeze(1)  # N, C, H*W
        else:
            y_true = F.one_hot(y_true, num_classes)
            y_true = y_true.permute(0, 2, 1)
        scores = soft_dice_score(y_pred, y_true.type_as(y_pred), smooth=self.smooth, eps=self.eps, dims=dims)
        loss = 1.0 - scores
        mask = y_true.sum(dims) > 0
        loss *= mask.to(loss.dtype)
        return loss.mean()


class SmpBinaryDiceLoss(nn.Module):
    """The binary mode: ``(N, 1, H, W)`` logits and label viewed ``(N, 1, H*W)``."""

    def forward(self, y_pred, y_true):
        bs = y_true.size(0)
        y_pred = F.logsigmoid(y_pred).exp()
        y_true = y_true.view(bs, 1, -1)
        y_pred = y_pred.view(bs, 1, -1)
        scores = soft_dice_score(y_pred, y_true.type_as(y_pred), dims=(0, 2))
        loss = (1.0 - scores) * (y_true.sum((0, 2)) > 0).to(scores.dtype)
        return loss.mean()


# ---- MONAI's one_hot and DiceCELoss (softmax, to_onehot_y), as its source writes them ----------------------------


def monai_one_hot(labels, num_classes: int, dtype=torch.float, dim: int = 1):
    if labels.ndim < dim + 1:
        shape = list(labels.shape) + [1] * (dim + 1 - len(labels.shape))
        labels = torch.reshape(labels, shape)
    sh = list(labels.shape)
    if sh[dim] != 1:
        raise AssertionError("labels should have a channel with length equal to one.")
    sh[dim] = num_classes
    o = torch.zeros(size=sh, dtype=dtype, device=labels.device)
    labels = o.scatter_(dim=dim, index=labels.long(), value=1)
    return labels


class MonaiDiceCELoss(nn.Module):
    def __init__(self, smooth_nr: float = 1e-5, smooth_dr: float = 1e-5) -> None:
        super().__init__()
        self.smooth_nr, self.smooth_dr = smooth_nr, smooth_dr
        self.cross_entropy = nn.CrossEntropyLoss()

    def dice(self, input, target):
        n_pred_ch = input.shape[1]
        input = torch.softmax(input, 1)
        target = monai_one_hot(target, num_classes=n_pred_ch, dtype=input.dtype)
        if target.shape != input.shape:
            raise AssertionError("ground truth has different shape")
        reduce_axis: list[int] = torch.arange(2, len(input.shape)).tolist()
        intersection = torch.sum(target * input, dim=reduce_axis)
        ground_o = torch.sum(target, dim=reduce_axis)
        pred_o = torch.sum(input, dim=reduce_axis)
        denominator = ground_o + pred_o
        f = 1.0 - (2.0 * intersection + self.smooth_nr) / (denominator + self.smooth_dr)
        return torch.mean(f)

    def ce(self, input, target):
        n_pred_ch, n_target_ch = input.shape[1], target.shape[1]
        if n_pred_ch != n_target_ch and n_target_ch == 1:
            target = torch.squeeze(target, dim=1)
            target = target.long()
        return self.cross_entropy(input, target)

    def forward(self, input, target):
        if input.dim() != target.dim():
            raise ValueError("the number of dimensions for input and target should be the same")
        return self.dice(input, target) + self.ce(input, target)


# ---- the cases -----------------------------------------------------------------------------------------------


def _fpn(policy):
    def run(x, y):
        torch.manual_seed(0)
        model = FPN(policy).double()
        torch.manual_seed(5)  # the dropout masks
        out = model(x)
        return out, F.cross_entropy(out, y)
    return run


def _smp_dice(ignore):
    def run(x, y):
        if ignore is not None:
            y = y.masked_fill(x[:, 0] > 1.0, ignore)  # some pixels ignored
        return None, SmpDiceLoss(ignore_index=ignore)(x, y)
    return run


def _smp_binary(x, y):
    return None, SmpBinaryDiceLoss()(x[:, :1], (y == 1).unsqueeze(1).to(x.dtype))


def _monai(x, y):
    target = monai_one_hot(y.unsqueeze(1), CLASSES, dtype=x.dtype)  # the one-hot label itself, and the loss
    return target, MonaiDiceCELoss()(x, y.unsqueeze(1))


def _dropout(func, p=0.4):
    def run(x, y):
        torch.manual_seed(3)
        out = func(x * 2.0, p, True)
        return out, (out * out).sum()
    return run


CASES = {  # name: (the computation on (logits or input, label), the input's shape, the grids)
    "FPN stack-sum merge": (_fpn("add"), (N, 2, 16, 16), [(2, 1), (1, 2)]),
    "FPN cat merge": (_fpn("cat"), (N, 2, 16, 16), [(2, 1), (1, 2)]),
    "smp DiceLoss": (_smp_dice(None), (N, CLASSES, 7, 6), [(2, 1), (1, 2)]),
    "smp DiceLoss ignore_index": (_smp_dice(255), (N, CLASSES, 7, 6), [(2, 1), (1, 2)]),
    "smp DiceLoss binary": (_smp_binary, (N, CLASSES, 7, 6), [(2, 1), (1, 2)]),
    "MONAI one_hot + DiceCELoss 2-D": (_monai, (N, CLASSES, 7, 6), [(2, 1), (1, 2)]),
    "MONAI one_hot + DiceCELoss 3-D": (_monai, (N, CLASSES, 3, 4, 7), [(1, 1, 2)]),
    "F.dropout3d": (_dropout(F.dropout3d), (N, 4, 3, 4, 7), [(1, 1, 2)]),
    "F.dropout2d on a volume": (_dropout(F.dropout2d), (N, 4, 3, 4, 7), [(1, 1, 2)]),
    "F.dropout2d on a signal": (_dropout(F.dropout2d), (N, 4, 9), [(2,)]),
    "F.dropout1d": (_dropout(F.dropout1d), (N, 4, 9), [(2,)]),
}


def _data(shape):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(*shape, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (shape[0], *shape[2:]), generator=g))


def _whole(t):
    if t is None:
        return None
    return (t.full() if isinstance(t, SpatialTensor) else t).detach()


def _compute(name, x, y):
    run = CASES[name][0]
    x = x.requires_grad_(True)
    out, loss = run(x, y)
    loss.backward()
    return _whole(out), loss.detach(), x.grad


def _split_run(rank, world, name, parts):
    shape = CASES[name][1]
    grid = create_hybrid_layout(parts).grid
    x, y = _data(shape)
    cut = tile_slices(shape[2:], parts, grid.index)
    tile = x[(..., *cut)].clone()
    xs = split_tensor(tile.requires_grad_(True), grid, x.shape)
    ys = split_tensor(y[(..., *cut)].clone(), grid, y.shape)
    before = state().gathers
    with on_unsupported("error"):  # computed on the tiles: a gather would raise
        out, loss = CASES[name][0](xs, ys)
        loss.backward()
    return {"out": _whole(out), "loss": loss.detach(), "grad": tile.grad, "cut": cut,
            "gathers": state().gathers - before, "loss_split": isinstance(loss, SpatialTensor)}


def _close(got, ref) -> bool:
    return got.shape == ref.shape and bool((got - ref).abs().max() <= TOL * max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("name", list(CASES))
def test_idiom_on_split_activations_gathers_nothing_and_equals_one_process(name):
    _, shape, grids = CASES[name]
    x, y = _data(shape)
    out_ref, loss_ref, grad_ref = _compute(name, x, y)
    for parts in grids:
        for rank, res in enumerate(run_in_processes(_split_run, 2, name, parts, timeout_s=300,
                                                    collective_timeout_s=120)):
            what = f"{name} at {parts} rank {rank}"
            assert res["gathers"] == 0, (what, res["gathers"])
            assert not res["loss_split"] and _close(res["loss"], loss_ref), (what, res["loss"], loss_ref)
            if out_ref is not None:
                assert _close(res["out"], out_ref), what
            assert _close(res["grad"], grad_ref[(..., *res["cut"])]), what


# ---- Trainer.fit: a 3-D U-Net with Dropout3d and MONAI's DiceCE + one_hot on sub-volumes -------------------------


class DiceCESegmenter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = DropoutUNet(3)
        self.loss = MonaiDiceCELoss()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self.model(x), y.unsqueeze(1))  # MONAI's labels carry a channel dimension
        self.log("train_loss", loss)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _dice_ce_run(rank: int, world: int, parts: tuple[int, ...] | None) -> dict:
    seed_everything(0)  # once, before the model is built, as a user's script does
    module = DiceCESegmenter()
    strategy = {} if parts is None else {"strategy": SpatialParallelStrategy(spatial_parts=parts),
                                         "use_distributed_sampler": False}
    before = state().gathers
    run = fit(module, datamodule=SubVolumes("volume"), devices=world, max_epochs=2, precision="64-true", **strategy)
    return {"params": run.params, "losses": module.losses, "gathers": state().gathers - before}


def test_unet_with_dropout3d_and_dice_ce_one_hot_loss_fits_sub_volumes_as_one_process_gathering_nothing():
    (ref,) = run_in_processes(_dice_ce_run, 1, None, timeout_s=300, collective_timeout_s=60)
    assert len(ref["losses"]) == 2 * N_VOLUMES // BATCH
    for rank, res in enumerate(run_in_processes(_dice_ce_run, 2, (1, 1, 2), timeout_s=600,
                                                collective_timeout_s=120)):
        what = f"1x1x2 rank {rank}"
        assert res["gathers"] == 0, (what, res["gathers"])
        for step, (loss, r) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(loss - r) <= FIT_TOL * max(1.0, abs(r)), (what, step, loss, r)
        for k, (p, r) in enumerate(zip(res["params"], ref["params"], strict=True)):
            err = float((p - r).abs().max())
            assert err <= FIT_TOL, f"{what}: parameter {k} differs by {err:.3g}"


# ---- what still gathers on a merged view: exact, and counted ------------------------------------------------------


def _scatter_into_viewed(x, y):
    o = torch.zeros(x.shape, dtype=x.dtype)
    channel0 = o[:, 0]  # a view of the plain tensor: it must see the one-hot as one process's does
    o.scatter_(1, y.unsqueeze(1), 1.0)
    return channel0 * 1.0, (x * o).sum()


GATHERED = {  # each gathers (the op has no tiled form on the layout), and equals one process
    "softmax over the merged positions": lambda x, y: (
        x.flatten(2).softmax(-1).view_as(x), (x.flatten(2).softmax(-1) * x.flatten(2)).sum()),
    "a slice of the merged dimension": lambda x, y: (None, (x.reshape(N, CLASSES, -1)[..., 3:11] ** 2).sum()),
    "cumsum along the merged dimension, viewed back": lambda x, y: (
        x.reshape(N, -1).cumsum(1).reshape(x.shape), x.reshape(N, -1).cumsum(1).mean()),
    "scatter_ into a plain tensor whose view is kept": _scatter_into_viewed,
}


def _gathered_run(rank, world, parts):
    grid = create_hybrid_layout(parts).grid
    shape = (N, CLASSES, 7, 6)
    x, y = _data(shape)
    cut = tile_slices(shape[2:], parts, grid.index)
    out = {}
    for name, run in GATHERED.items():
        tile = x[(..., *cut)].clone().requires_grad_(True)
        before = state().gathers
        res, loss = run(split_tensor(tile, grid, x.shape), split_tensor(y[(..., *cut)].clone(), grid, y.shape))
        loss.backward()
        out[name] = {"out": _whole(res), "loss": loss.detach(), "grad": tile.grad, "cut": cut,
                     "gathers": state().gathers - before}
    return out


def test_ops_without_a_tiled_form_on_a_merged_view_are_gathered_and_equal_one_process():
    shape = (N, CLASSES, 7, 6)
    refs = {}
    for name, run in GATHERED.items():
        x, y = _data(shape)
        x.requires_grad_(True)
        out, loss = run(x, y)
        loss.backward()
        refs[name] = (_whole(out), loss.detach(), x.grad)
    for parts in ((2, 1), (1, 2)):
        for rank, res in enumerate(run_in_processes(_gathered_run, 2, parts, timeout_s=300,
                                                    collective_timeout_s=120)):
            for name, (out_ref, loss_ref, grad_ref) in refs.items():
                got, what = res[name], f"{name} at {parts} rank {rank}"
                assert got["gathers"] > 0, what
                assert _close(got["loss"], loss_ref), (what, got["loss"], loss_ref)
                if out_ref is not None:
                    assert _close(got["out"], out_ref), what
                assert _close(got["grad"], grad_ref[(..., *got["cut"])]), what

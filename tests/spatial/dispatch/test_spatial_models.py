"""Whole models in a plain-torch loop (no Lightning): each rank wraps its tile (``split_tensor``) and runs the
unchanged model, the op dispatch records the parameters used on tiles and ``reduce_model_gradients`` reduces
them.  An FCN training step on 1, 2 and 4 processes gives the serial loss and parameters, and ResNet-50 on a
small input gives the serial outputs and gradients (fp32, 1e-5 relative to each tensor's magnitude)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_range
from lightning_hpc.spatial.dispatch import split_tensor
from lightning_hpc.spatial.dispatch.split_check import check_split
from lightning_hpc.spatial.layout.gradients import reduce_model_gradients
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import TOL, max_err, tile_of

SHAPE = (4, 3, 30, 26)  # 30 and 26 split unevenly over 4 and 2; stride-2 layers make them odd
STEPS = 2


def small_fcn() -> nn.Module:
    """A mesh-FCN in miniature (section VI): conv-BN-ReLU blocks, stride-2 first conv per block, a pooling
    layer with kernel > stride, a 1x1 prediction conv and upsampling back to the input resolution."""
    torch.manual_seed(1)
    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(
        *block(3, 8, 1), *block(8, 8, 2), *block(8, 8, 1), nn.MaxPool2d(3, 1, 1), *block(8, 12, 2),
        nn.Conv2d(12, 1, 1), nn.Upsample(size=SHAPE[2:], mode="bilinear"),
    )


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*SHAPE, generator=g)
    y = (torch.rand(SHAPE[0], 1, SHAPE[2], SHAPE[3], generator=g) > 0.7).float()
    return x, y


def pixel_loss(logits, target, total_pixels):
    """Whole-sample loss: per-pixel losses summed (over the whole sample, for split tensors), divided by the
    pixels of the whole samples."""
    return F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / total_pixels


def serial_training(num_sample_groups: int):
    """Reference: one process; sample groups emulated by running each group's samples separately (batch norm
    statistics are per sample group, as in data parallelism) and averaging their losses."""
    model = small_fcn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for g in range(num_sample_groups):
            s0, s1 = block_range(SHAPE[0], num_sample_groups, g)
            loss = pixel_loss(model(x[s0:s1]), y[s0:s1], y[s0:s1].numel()) / num_sample_groups
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def _spatial_training(rank: int, world: int, parts_list):
    out = {}
    for parts in parts_list:
        layout = create_hybrid_layout(parts)
        grid = layout.grid
        model = small_fcn()
        check_split(model, SHAPE[1:], parts)  # every layer can be split so (raises naming the layer otherwise)
        grid.tile_params.clear()  # the dispatch records this model's tile parameters afresh
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = data()
        s0, s1 = block_range(SHAPE[0], layout.num_sample_groups, layout.sample_index)
        xs, ys = x[s0:s1], y[s0:s1]
        xt = split_tensor(tile_of(xs, grid), grid, xs.shape)
        yt = split_tensor(tile_of(ys, grid), grid, ys.shape)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pixel_loss(model(xt), yt, ys.numel())  # the sample group's loss, the same on its tiles
            loss.backward()
            reduce_model_gradients(model, layout.num_sample_groups, grid.tile_params)
            total = loss.detach().clone() / (layout.num_sample_groups * grid.size)
            torch.distributed.all_reduce(total)
            losses.append(float(total))
            opt.step()
        out[parts] = (losses, [p.detach().numpy().copy() for p in model.parameters()])  # numpy: pickles by value
    return out


@pytest.mark.parametrize("world,parts_list", [(2, [(1, 2)]), (4, [(2, 2), (2, 1)])])
def test_fcn_training_step_matches_serial(world, parts_list):
    results = run_in_processes(_spatial_training, world, parts_list, timeout_s=300, collective_timeout_s=120)
    for parts in parts_list:
        groups = world // (parts[0] * parts[1])
        ref_losses, ref_params = serial_training(groups)
        for rank, res in enumerate(results):
            losses, params = res[parts]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (parts, rank, losses, ref_losses)
            errs = [max_err(torch.from_numpy(p), q) for p, q in zip(params, ref_params)]
            assert max(errs) <= TOL, (parts, rank, errs)


def _resnet(rank: int, world: int, parts, shape):
    from lightning_hpc.models import resnet50

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    ref = resnet50(num_classes=10)
    layout = create_hybrid_layout(parts)
    sp = copy.deepcopy(ref)
    check_split(sp, shape[1:], parts)
    layout.grid.tile_params.clear()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_(True)
    xt = tile_of(x, layout.grid).clone().requires_grad_(True)
    yr, yt = ref(xr), sp(split_tensor(xt, layout.grid, x.shape))
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(4))
    (yr * g).sum().backward()
    (yt * g).sum().backward()
    reduce_model_gradients(sp, layout.num_sample_groups, layout.grid.tile_params)
    errs = {"out": max_err(yt, yr), "dx": max_err(xt.grad, tile_of(xr.grad, layout.grid))}
    worst = max(
        (max_err(ps.grad, pr.grad), n) for (n, pr), (_, ps) in zip(ref.named_parameters(), sp.named_parameters())
    )
    errs["worst_param_grad"] = worst[0]
    errs["worst_param"] = worst[1]
    return errs


def test_resnet50_small_input_matches_serial():
    # float64: in fp32 the serial and the tiled sums round differently and 53 batch norms over a 2 x 2 final map
    # amplify that to ~1e-4; in float64 both agree to ~1e-12, which shows the algorithm is exact
    for errs in run_in_processes(_resnet, 2, (2, 1), (1, 3, 64, 48), timeout_s=300, collective_timeout_s=120):
        assert errs["out"] <= 1e-9 and errs["dx"] <= 1e-9 and errs["worst_param_grad"] <= 1e-9, errs

"""K-FAC with spatial parallelism: conv factors summed over the spatial group, averaged over sample groups.

Every rank's running factors must equal serial K-FAC's factors for the whole samples of the mini-batch, and the
parameters after several SGD + K-FAC steps must equal one process training the unpartitioned model (fp32, 1e-5).
Tiles are uneven (13 x 11 input over 2 and 4 parts) and the models have strided, dilated and 1x1-strided convs,
a bias, and a global-average-pool + Linear head (whose factors must not be counted once per tile).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_range
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.layers import TiledConvHandler
from lightning_hpc.models.mesh_fcn import mesh_fcn
from lightning_hpc.modules.segmentation import SegmentationModule, pixel_loss_sum
from lightning_hpc.spatial.dispatch import split_tensor
from lightning_hpc.spatial.dispatch.kfac_contract import declare_tiled_convolutions
from lightning_hpc.spatial.layout.gradients import reduce_model_gradients
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.spatial_checks import TileDataModule

TOL = 1e-5
BATCH, C, H, W = 4, 3, 13, 11  # 13 and 11 split unevenly over 2 and 4; strided layers make odd extents
STEPS = 3
KFAC_OPTIONS = dict(
    factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01, decomposition_dtype=torch.float64
)


def seg_net() -> nn.Module:
    """Tiled output: 3x3 conv with bias, 3x3/s2, dilated 3x3, 1x1/s2 (every kind of halo incl. none)."""
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Conv2d(C, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2, padding=1, bias=False), nn.Tanh(),
        nn.Conv2d(5, 4, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv2d(4, 2, 1, stride=2),
    )


def cls_net() -> nn.Module:
    """Replicated output: convs, global average pooling, Linear head."""
    torch.manual_seed(6)
    return nn.Sequential(
        nn.Conv2d(C, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5),
    )


def batch_data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, C, H, W, generator=g)
    seg_y = torch.randn(BATCH, 2, 4, 3, generator=g)  # seg_net's output extent for 13 x 11
    cls_y = torch.randint(0, 5, (BATCH,), generator=g)
    return x, seg_y, cls_y


def seg_loss(out, y, samples):
    """Mean over samples of the summed squared error (of split tensors: summed over the whole sample)."""
    return ((out - y) ** 2).sum() / samples


def _tile(t, grid):
    rs, cs = tile_slices((t.shape[-2], t.shape[-1]), grid.parts, grid.index)
    return t[..., rs, cs]


def _train(model, precond, opt, step_fn, steps=STEPS, before_step=None):
    """SGD + K-FAC steps; returns factors after the first step and after the last, and the parameters."""
    first = None
    for step in range(steps):
        opt.zero_grad()
        step_fn().backward()
        if before_step is not None:
            before_step(step)
        precond.step()
        opt.step()
        if step == 0:
            first = {n: {k: v.clone() for k, v in f.items()} for n, f in precond.factors.items()}
    last = {n: {k: v.clone() for k, v in f.items()} for n, f in precond.factors.items()}
    return first, last, [p.detach().clone() for p in model.parameters()]


def serial_run(kind: str, placement: str):
    model = seg_net() if kind == "seg" else cls_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, placement=placement, **KFAC_OPTIONS)
    x, seg_y, cls_y = batch_data()
    if kind == "seg":
        step = lambda: seg_loss(model(x), seg_y, BATCH)  # noqa: E731
    else:
        step = lambda: F.cross_entropy(model(x), cls_y)  # noqa: E731
    return _train(model, precond, opt, step)


def _spatial_worker(rank: int, world: int, configs):
    out = []
    for parts, placement, overlap in configs:
        layout = create_hybrid_layout(parts)
        grid = layout.grid
        s0, s1 = block_range(BATCH, layout.num_sample_groups, layout.sample_index)
        x, seg_y, cls_y = batch_data()
        grid.policy.overlap = overlap  # the strategy's setting, read by the convolution handler
        for kind in ("seg", "cls"):
            model = seg_net() if kind == "seg" else cls_net()
            # as the strategy does: the unchanged model, its convolutions in a registry of tiled layers that the
            # grid carries (the convolution handler records the tile's box for the layer K-FAC asks about) and
            # K-FAC is handed
            layers = declare_tiled_convolutions(model, grid.size, grid)
            grid.tile_params.clear()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            precond = KFACPreconditioner(model, optimizer=opt, placement=placement, tiled_layers=layers,
                                         **KFAC_OPTIONS)
            xt = split_tensor(_tile(x[s0:s1], grid), grid, x[s0:s1].shape)
            if kind == "seg":
                yt = split_tensor(_tile(seg_y[s0:s1], grid), grid, seg_y[s0:s1].shape)
                step = lambda: seg_loss(model(xt), yt, s1 - s0)  # noqa: E731
            else:
                step = lambda: F.cross_entropy(model(xt), cls_y[s0:s1])  # noqa: E731
            local = {}

            def before_step(i: int) -> None:
                reduce_model_gradients(model, layout.num_sample_groups, grid.tile_params)
                if i == 0:  # this rank's own (tile) factors, to show the reduction is what makes them equal
                    local.update({h.name: h.batch_factors()[0].clone() for h in precond.handlers})

            first, last, params = _train(model, precond, opt, step, before_step=before_step)
            tiled = sorted(h.name for h in precond.handlers if isinstance(h, TiledConvHandler))
            out.append(dict(parts=parts, placement=placement, kind=kind, first=first, last=last, params=params,
                            local=local, tiled=tiled))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check(results):
    refs = {}
    for rank_out in results:
        for res in rank_out:
            key = (res["kind"], res["placement"])
            if key not in refs:
                refs[key] = serial_run(*key)
            first, last, params = refs[key]
            where = f"{res['kind']} parts={res['parts']} placement={res['placement']}"
            assert set(res["first"]) == set(first), where
            for name in first:
                for k in ("A", "G"):
                    assert _rel(res["first"][name][k], first[name][k]) <= TOL, (where, name, k)
                    assert _rel(res["last"][name][k], last[name][k]) <= TOL, (where, name, k)
            for p, q in zip(res["params"], params):
                assert float((p - q).abs().max()) <= TOL, where
            # every conv is tiled; the Linear head is not (its factors are complete on each rank)
            convs = {n for n in first if n != "6"} if res["kind"] == "cls" else set(first)
            assert set(res["tiled"]) == convs, where
            # the test can fail: a tile's own A (before the reduction) is far from the whole-sample A
            if res["parts"] != (1, 1):
                assert max(_rel(res["local"][n], first[n]["A"]) for n in res["tiled"]) > 1e-2, where


# with and without overlap (K-FAC's recorded forwards take the kernel's box path, the others its tile path)
CONFIGS_2 = [((2, 1), "balanced", False), ((1, 2), "round_robin", True)]
CONFIGS_4 = [
    ((2, 2), "balanced", False),
    ((4, 1), "layer_wise", True),
    ((2, 1), "round_robin", False),
]  # last: 2 sample groups


def test_kfac_factors_and_steps_2_processes():
    _check(run_in_processes(_spatial_worker, 2, CONFIGS_2, timeout_s=300, collective_timeout_s=120))


def test_kfac_factors_and_steps_4_processes():
    _check(run_in_processes(_spatial_worker, 4, CONFIGS_4, timeout_s=300, collective_timeout_s=120))


# -- single process: the 1x1 grid path and the setup errors --------------------------------------------------------
def test_single_tile_grid_equals_plain_conv():
    """Tiled convolutions on one tile per sample record the border-padded input (the registry pads an input that
    is not split); their factors equal plain K-FAC's."""
    ref = serial_run("seg", "balanced")
    model = seg_net()
    layers = declare_tiled_convolutions(model, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, tiled_layers=layers, **KFAC_OPTIONS)
    assert all(isinstance(h, TiledConvHandler) for h in precond.handlers)
    x, seg_y, _ = batch_data()
    first, last, params = _train(model, precond, opt, lambda: seg_loss(model(x), seg_y, BATCH))
    for name in ref[0]:
        for k in ("A", "G"):
            assert _rel(first[name][k], ref[0][name][k]) <= TOL
            assert _rel(last[name][k], ref[1][name][k]) <= TOL
    for p, q in zip(params, ref[2]):
        assert float((p - q).abs().max()) <= TOL


def test_partition_larger_than_world_is_rejected():
    model = seg_net()
    layers = declare_tiled_convolutions(model, 2)  # a 2-tile grid in a 1-rank world
    with pytest.raises(ValueError, match=r"split each sample over \[2\] ranks.*world of 1 ranks"):
        KFACPreconditioner(model, tiled_layers=layers)


def test_hooks_running_on_another_layer_fail_clearly():
    model = seg_net()
    KFACPreconditioner(model, **KFAC_OPTIONS)
    copied = copy.deepcopy(model)  # a copy made after the hooks shares them: they would see the copy's layers
    with pytest.raises(RuntimeError, match="create the KFACPreconditioner for the model that trains"):
        copied(batch_data()[0])


# -- Lightning: Trainer(strategy=SpatialParallelStrategy, callbacks=[KFAC]) on the mesh FCN -----------------------
FCN_SHAPE = (6, 3, 16, 12)  # 16 x 12 over 2 tiles; two stride-2 blocks, upsampled x4 back
FCN_BATCH, FCN_STEPS = 2, 3


def fcn() -> nn.Module:
    torch.manual_seed(2)
    return mesh_fcn(in_channels=3, convs_per_block=2, widths=(4, 6))


def fcn_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*FCN_SHAPE, generator=g)
    y = (torch.rand(FCN_SHAPE[0], 1, *FCN_SHAPE[2:], generator=g) > 0.6).float()
    return x, y


def _kfac_fcn_run(rank: int, world: int, parts):
    module = SegmentationModule(fcn(), optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    kfac = KFAC(**{**KFAC_OPTIONS, "decomposition_dtype": "float64"})
    run = fit(module, datamodule=TileDataModule(*fcn_data(), batch_size=FCN_BATCH), devices=world,
              strategy=SpatialParallelStrategy(spatial_parts=parts), callbacks=[kfac], max_steps=FCN_STEPS,
              params=lambda m: m.model.parameters())
    pre = kfac.preconditioner
    assert pre is not None
    return {
        "tiled": sum(isinstance(h, TiledConvHandler) for h in pre.handlers),
        "handlers": len(pre.handlers),
        "factors": {n.removeprefix("model."): {k: v.clone() for k, v in f.items()} for n, f in pre.factors.items()},
        "params": run.params,
    }


def serial_fcn():
    model = fcn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # the spatial strategy's BatchNorm normalises over the tiles, so K-FAC leaves it to the optimizer there (listed
    # with the reason); the serial reference leaves its BatchNorm layers alike
    precond = KFACPreconditioner(model, optimizer=opt, layer_types=["conv"], **KFAC_OPTIONS)
    x, y = fcn_data()
    # Lightning shuffles training data with a DistributedSampler (one replica here: one sample group)
    order = list(DistributedSampler(TensorDataset(x), num_replicas=1, rank=0, shuffle=True, seed=0))
    batches = iter(range(FCN_STEPS))

    def step():
        idx = order[next(batches) * FCN_BATCH :][:FCN_BATCH]
        xb, yb = x[idx], y[idx]
        return pixel_loss_sum(model(xb), yb) / yb.numel()

    _, last, params = _train(model, precond, opt, step, steps=FCN_STEPS)
    return last, params


def test_lightning_trainer_spatial_with_kfac_matches_serial():
    results = run_in_processes(_kfac_fcn_run, 2, (2, 1), timeout_s=300, collective_timeout_s=120)
    factors, params = serial_fcn()
    for res in results:
        assert res["tiled"] == res["handlers"] == 5  # every conv of the FCN, hooked after the strategy declared it
        assert set(res["factors"]) == set(factors)
        for name in factors:
            for k in ("A", "G"):
                assert _rel(res["factors"][name][k], factors[name][k]) <= TOL, (name, k)
        for p, q in zip(res["params"], params):
            assert float((p - q).abs().max()) <= TOL

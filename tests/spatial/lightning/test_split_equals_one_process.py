"""``Trainer(strategy="spatial")`` with unchanged user models and LightningModules equals one process.

Each idiom is a model written as a user would, trained through ``Trainer.fit`` by a LightningModule with a plain
mean loss (``F.cross_entropy(out, y)``) and ``self.log("train_loss", loss)``.  On 2 ranks (2x1 and 1x2, uneven
tiles: H = 13) the logged loss, the first step's parameter gradients, the parameters after 3 steps and the
outputs must equal one process's at 1e-5 -- or the run must be refused before the first optimizer step with a
message naming the op and the module.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.layout.tiling import tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.spatial_checks import serial_sgd_fit

TOL = 1e-5
N, C, H, W = 4, 3, 13, 10
BATCH, STEPS, CLASSES = 2, 3, 3


# ------------------------------------------------------------------------------------------------------------
# model idioms (as found in public code bases)
# ------------------------------------------------------------------------------------------------------------
class UNetPadToSkip(nn.Module):
    """Bilinear F.interpolate, F.pad to the skip's size (odd H), cat, in-place ReLU, BatchNorm momentum=None."""

    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(inplace=True))
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
        self.up_conv = nn.Conv2d(10, 4, 3, padding=1)
        self.outc = nn.Conv2d(4, CLASSES, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down(x1)
        x2 = F.interpolate(x2, scale_factor=2, mode="bilinear", align_corners=True)
        dy, dx = x1.size()[2] - x2.size()[2], x1.size()[3] - x2.size()[3]
        x2 = F.pad(x2, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.outc(F.relu(self.up_conv(torch.cat([x1, x2], dim=1))))


class UNetCrop(nn.Module):
    """Valid convolutions, ConvTranspose2d, centre-crop of the skip, output smaller than the input (the loss
    crops the target the same way)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(C, 4, 3)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(4, 4, 1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(8, CLASSES, 1)

    def forward(self, x):
        s = F.relu(self.c1(x))
        u = self.up(F.relu(self.c2(self.pool(s))))
        top, left = (s.shape[2] - u.shape[2]) // 2, (s.shape[3] - u.shape[3]) // 2
        s = s[:, :, top : top + u.shape[2], left : left + u.shape[3]]
        return self.out(torch.cat([s, u], 1))


class MyConv(nn.Conv2d):
    pass


class SubclassesAndParametrizations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = MyConv(C, 4, 3, padding=1)
        self.b = parametrizations.weight_norm(nn.Conv2d(4, 4, 3, padding=1))
        self.c = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.d = nn.Conv2d(4, CLASSES, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        return self.d(torch.tanh(self.c(F.silu(self.b(F.relu(self.a(x)))))))


class SEBlock(nn.Module):
    """Squeeze-and-excitation (x.mean((2, 3)) gate multiplied into the tiles), PReLU, a bare scale parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, 6, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(6, 3), nn.Linear(3, 6)
        self.act = nn.PReLU(6)
        self.scale = nn.Parameter(torch.full((1, 6, 1, 1), 0.5))
        self.head = nn.Conv2d(6, CLASSES, 1)

    def forward(self, x):
        x = self.act(self.conv(x))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3))))))
        return self.head(x * gate[:, :, None, None] * self.scale)


class PerPixelLinear(nn.Module):
    """ConvNeXt block: depthwise conv, channels-last LayerNorm and Linear per pixel, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(C, 4, 1)
        self.dw = nn.Conv2d(4, 4, 7, padding=3, groups=4)
        self.norm = nn.LayerNorm(4)
        self.pw1, self.pw2 = nn.Linear(4, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        x = self.dw(self.stem(x)).permute(0, 2, 3, 1)
        x = self.pw2(F.gelu(self.pw1(self.norm(x))))
        return x.permute(0, 3, 1, 2)


class AttentionOverPositions(nn.Module):
    """Attention pooling: softmax over all positions, a Flatten + Linear head (classification)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3, padding=1)
        self.score = nn.Conv2d(4, 1, 1)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        f = F.relu(self.conv(x))
        attn = torch.softmax(self.score(f).flatten(2), dim=-1)  # (N, 1, HW)
        pooled = (f.flatten(2) * attn).sum(-1)
        return self.head(pooled)


class Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(C, 4, 3, padding=1)
        self.d1, self.d2 = nn.Dropout(0.3), nn.Dropout2d(0.5)
        self.c2 = nn.Conv2d(4, CLASSES, 3, padding=1)

    def forward(self, x):
        return self.c2(self.d2(self.d1(F.relu(self.c1(x)))))


class FlattenHead(nn.Module):
    """Parameters after the pool (BatchNorm on N x C x 1 x 1, PReLU), and a Flatten + Linear head without a
    global pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3, padding=1, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.PReLU()
        self.flat_head = nn.Linear(4 * 7 * 5, CLASSES)
        self.pool_head = nn.Linear(4, CLASSES)

    def forward(self, x):
        f = F.relu(self.conv(x))
        p = self.act(self.bn(self.pool(f))).flatten(1)
        return self.flat_head(torch.flatten(f, 1)) + self.pool_head(p)


class CoordsStridesNorms(nn.Module):
    """CoordConv (coordinates from x.shape), GroupNorm, InstanceNorm2d, max-pool with padding and ceil_mode,
    x[..., ::2, ::2], F.unfold-free strided slicing, nearest upsampling back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C + 2, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.inorm = nn.InstanceNorm2d(6, affine=True)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.out = nn.Conv2d(12, CLASSES, 1)

    def forward(self, x):
        n, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h).view(1, 1, h, 1).expand(n, 1, h, w)
        xs = torch.linspace(-1, 1, w).view(1, 1, 1, w).expand(n, 1, h, w)
        f = F.relu(self.gn(self.conv(torch.cat([x, ys, xs], dim=1))))
        a = self.pool(self.inorm(f))
        b = f[..., ::2, ::2]
        a = F.interpolate(a, size=f.shape[-2:], mode="nearest")
        b = F.interpolate(b, size=f.shape[-2:], mode="nearest")
        return self.out(torch.cat([a, b], 1))


class SharedSubmodules(nn.Module):
    """Blocks registered under two names, as MONAI's ``DynUNet`` keeps its blocks as attributes and again in a
    list of skip layers (the setup-time shape trace left such layers' parameters on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_block = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.bottleneck = nn.Sequential(nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.ReLU())
        self.skip_layers = nn.ModuleList([self.input_block, self.bottleneck])
        self.head = nn.Conv2d(8, CLASSES, 1)

    def forward(self, x):
        skip = self.skip_layers[0](x)
        return self.head(torch.cat([skip, self.bottleneck(skip)], dim=1))


class WrongChannels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(C, 4, 3, padding=1)
        self.body = nn.Conv2d(5, CLASSES, 3, padding=1)  # expects 5 channels, gets 4

    def forward(self, x):
        return self.body(self.stem(x))


class SharedAcrossPool(nn.Module):
    """One Linear used per pixel (on tiles) and on the pooled features (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, 4, 3, padding=1)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Conv2d(4, CLASSES, 1)

    def forward(self, x):
        f = self.mix(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        g = self.mix(f.mean((2, 3)))
        return self.out(f * g[:, :, None, None])


class InPlaceEdit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, CLASSES, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        y[:, :, 0] = 0.0  # in place on a split dimension
        return y


class Flip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, CLASSES, 3, padding=1)

    def forward(self, x):
        return torch.flip(self.conv(x), dims=(2, 3))


IDIOMS = {
    "unet_pad_to_skip": (UNetPadToSkip, "seg"),
    "unet_centre_crop": (UNetCrop, "seg"),
    "subclass_parametrization_padding_modes": (SubclassesAndParametrizations, "seg"),
    "se_block": (SEBlock, "seg"),
    "per_pixel_linear": (PerPixelLinear, "seg"),
    "attention_over_positions": (AttentionOverPositions, "cls"),
    "flatten_head_params_after_pool": (FlattenHead, "cls"),
    "dropout": (Dropouts, "seg"),
    "coords_strides_norms": (CoordsStridesNorms, "seg"),
    "shared_submodules": (SharedSubmodules, "seg"),
    # one Linear per pixel (its gradient a partial sum over tiles) and on the pooled features (replicated: each
    # rank's use gets 1/P of its gradient, spatial.dispatch.parameter_check)
    "shared_across_pool": (SharedAcrossPool, "seg"),
}


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, H, W, generator=g)
    seg = torch.randint(0, CLASSES, (N, H, W), generator=g)
    cls = torch.randint(0, CLASSES, (N,), generator=g)
    return x, seg, cls


def compute_loss(model, x, y):
    out = model(x)
    if y.dim() == 3 and out.shape[-2:] != y.shape[-2:]:  # valid convolutions: centre-crop the target
        top, left = (y.shape[1] - out.shape[2]) // 2, (y.shape[2] - out.shape[3]) // 2
        y = y[:, top : top + out.shape[2], left : left + out.shape[3]]
    return F.cross_entropy(out, y)


class UserModule(pl.LightningModule):
    """An ordinary LightningModule: plain mean loss, self.log."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.first_grads = None
        self.all_grads: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        torch.manual_seed(100 + batch_idx)  # the serial loop seeds the same way: dropout masks are comparable
        loss = compute_loss(self.model, x, y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        self.all_grads.append(grads)
        if self.first_grads is None:
            self.first_grads = grads

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TileData(pl.LightningDataModule):
    def __init__(self, x, y) -> None:
        super().__init__()
        self.x, self.y, self.tile = x, y, None
        self.input_shape = tuple(x.shape[1:])
        self.spatial_tiles = (0, 1) if y.dim() >= 3 else (0,)  # the batch entries read as tiles

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        x, y = self.x, self.y
        if self.tile is not None:
            rs, cs = tile_slices((x.shape[-2], x.shape[-1]), self.tile[1], self.tile[0])
            x = x[..., rs, cs].contiguous()
            y = y[..., rs, cs].contiguous() if y.dim() >= 3 else y
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def build(name):
    cls, _ = (
        IDIOMS.get(name, (None, None))
        if name in IDIOMS
        else (
            {
                "inplace_edit": InPlaceEdit,
                "flip": Flip,
                "wrong_channels": WrongChannels,
            }[name],
            "seg",
        )
    )
    torch.manual_seed(0)
    return cls()


def target_for(name, seg, cls):
    kind = IDIOMS[name][1] if name in IDIOMS else "seg"
    return seg if kind == "seg" else cls


def serial(name):
    x, seg, cls = make_data()
    return serial_sgd_fit(build(name), x, target_for(name, seg, cls), compute_loss, BATCH, step_seed=100)


def _split_run(rank, world, parts, names, on_unsupported="gather"):
    from lightning_hpc.spatial.dispatch import split_tensor

    results = {}
    x, seg, cls = make_data()
    for name in names:
        y = target_for(name, seg, cls)
        module = UserModule(build(name))
        strategy = SpatialParallelStrategy(spatial_parts=parts, on_unsupported=on_unsupported)
        # one spatial group: same order as the serial loop
        run = fit(module, datamodule=TileData(x, y), devices=world, strategy=strategy, max_steps=STEPS, max_epochs=1,
                  use_distributed_sampler=False, refusal_is_result=True, record_warnings=True,
                  params=lambda m: m.model.parameters())
        if run.error is not None:  # the refusal is the result
            results[name] = {"error": run.error, "steps": run.steps}
            continue
        grid = strategy.layout.grid
        module.eval()
        rs, cs = tile_slices((H, W), parts, grid.index)
        with torch.no_grad():
            out = module.model(split_tensor(x[..., rs, cs].contiguous(), grid, x.shape))
            out = out.full() if hasattr(out, "full") else out
        results[name] = {
            "loss": run.metric(),
            "grads": [g.clone() for g in module.first_grads] if module.first_grads else [],
            "all_grads": module.all_grads,
            "params": run.params,
            "out": out.detach().clone(),
            "warnings": run.warned("spatial:"),
        }
    return results


def _err(a, b) -> float:
    return float((a - b).abs().max() / max(1.0, float(b.abs().max()))) if a.numel() else 0.0


def _check_equal(res, ref, name, tol=TOL):
    assert "error" not in res, f"{name}: refused: {res.get('error')}"
    assert abs(res["loss"] - ref["loss"]) <= tol * max(1.0, abs(ref["loss"])), (name, res["loss"], ref["loss"])
    assert len(res["grads"]) == len(ref["grads"])
    for k, (g, r) in enumerate(zip(res["grads"], ref["grads"])):
        assert _err(g, r) <= tol, f"{name}: gradient of parameter {k} differs by {_err(g, r)}"
    for k, (p, r) in enumerate(zip(res["params"], ref["params"])):
        assert _err(p, r) <= tol, f"{name}: parameter {k} after {STEPS} steps differs by {_err(p, r)}"
    assert res["out"].shape == ref["out"].shape, (name, res["out"].shape, ref["out"].shape)
    assert _err(res["out"], ref["out"]) <= tol, f"{name}: outputs differ by {_err(res['out'], ref['out'])}"


@pytest.fixture(scope="module")
def serial_refs():
    return {name: serial(name) for name in IDIOMS}


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_idioms_equal_one_process(parts, serial_refs):
    results = run_in_processes(_split_run, 2, parts, list(IDIOMS), timeout_s=600, collective_timeout_s=120)
    for rank_res in results:
        for name in IDIOMS:
            _check_equal(rank_res[name], serial_refs[name], f"{name} at {parts[0]}x{parts[1]}")
    warned = " ".join(w for name in IDIOMS for w in results[0][name]["warnings"])
    # ops without a tiled form were gathered, and said so with the op, the module and the bytes (the flatten is
    # tiled: the softmax over all its positions is not)
    assert "torch.softmax in module 'model'" in warned and "bytes per rank" in warned, warned
    assert "Tensor.flatten" not in warned, warned
    # constant padding to the skip's size, centre crops and strided slices are tiled: the U-Nets gather nothing
    for name in ("unet_pad_to_skip", "unet_centre_crop", "coords_strides_norms", "shared_submodules"):
        assert not results[0][name]["warnings"], (name, results[0][name]["warnings"])
    # transposed convolution, group and instance norm have tiled forms: never gathered
    assert "conv_transpose2d" not in warned and "group_norm" not in warned and "instance_norm" not in warned, warned
    # so have reflect/circular padding and max pooling with ceil_mode
    assert not results[0]["subclass_parametrization_padding_modes"]["warnings"], warned
    assert "max_pool2d" not in " ".join(results[0]["coords_strides_norms"]["warnings"]), warned


def test_refusals_name_op_and_module():
    results = run_in_processes(_split_run, 2, (2, 1), ["inplace_edit"], timeout_s=300, collective_timeout_s=60)
    for res in results:
        err = res["inplace_edit"]["error"]
        assert "Tensor.__setitem__" in err and "module 'model' (InPlaceEdit)" in err, err
        assert "F.pad(x[..., 1:, :], (0, 0, 1, 0))" in err and "clone()" not in err, err  # a rewrite that works
        assert res["inplace_edit"]["steps"] == 0  # before the first optimizer step
    wrong = run_in_processes(_split_run, 2, (2, 1), ["wrong_channels"], timeout_s=300, collective_timeout_s=60)
    for res in wrong:
        err = res["wrong_channels"]["error"]
        assert "module 'model.body'" in err and "channels" in err, err
    strict = run_in_processes(_split_run, 2, (1, 2), ["flip"], "error", timeout_s=300, collective_timeout_s=60)
    for res in strict:
        err = res["flip"]["error"]
        assert (
            "torch.flip in module 'model' (Flip)" in err
            and "on_unsupported" not in err.split("SpatialDispatchError")[0]
        ), err
        assert res["flip"]["steps"] == 0


def _one_rank_fails(rank, world, failing=1):
    module = UserModule(build("flip"))

    class FailOnRank1(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == failing and batch_idx == 1:
                raise RuntimeError(f"bad sample on rank {failing}")

    x, seg, _ = make_data()
    strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    run = fit(module, datamodule=TileData(x, seg), devices=world, strategy=strategy, max_steps=STEPS,
              callbacks=[FailOnRank1()], refusal_is_result=True)
    return {"error": run.error}


# rank 0 failing (it hosts the store the message travels through) is the default tier's case; rank 1, the slow tier's
@pytest.mark.parametrize("failing", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_failure_on_one_rank_ends_every_rank_promptly(failing, monkeypatch):
    """One rank fails before its second step while its peer enters it (halo exchanges): the peer must not wait for the
    collective timeout (set longer than the run's deadline), and ends with the failing rank's message -- also when
    the failing rank is rank 0, which hosts the store the message travels through: gloo releases the peer only when
    rank 0's process exits, which takes the store with it, so the message must reach the peer before (its peer saw
    only gloo's closed connection when it read the store after its release).

    The ranks are fresh interpreters, as torchrun and Lightning start them."""
    monkeypatch.setenv("LIGHTNING_HPC_START_METHOD", "spawn")
    # the collectives' timeout is longer than the run's deadline: a peer released by its timeout fails the run
    results = run_in_processes(_one_rank_fails, 2, failing, timeout_s=120, collective_timeout_s=900)
    peer = 1 - failing
    assert f"bad sample on rank {failing}" in results[failing]["error"]
    assert results[peer]["error"] is not None, f"rank {peer} finished although its peer failed"
    assert f"bad sample on rank {failing}" in results[peer]["error"], results[peer]["error"]


@pytest.mark.slow
def test_idioms_equal_one_process_2x2(serial_refs):
    """4 ranks on a 2x2 grid (uneven rows: H = 13); slow on a 2-core machine."""
    results = run_in_processes(_split_run, 4, (2, 2), list(IDIOMS), timeout_s=1200, collective_timeout_s=300)
    for rank_res in results:
        for name in IDIOMS:
            # four partial sums per parameter gradient: fp32 summation order moved them by about 1e-5
            _check_equal(rank_res[name], serial_refs[name], f"{name} at 2x2", tol=5e-5)

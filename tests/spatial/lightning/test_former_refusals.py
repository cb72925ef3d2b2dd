"""Idioms that used to end in torch's own error or in a refusal whose fix could not help, now computed on the
tiles exactly as one process: an even-kernel ``padding="same"`` convolution, ``nn.SyncBatchNorm`` on CPU, a
convolution after ``transpose(2, 3)``, a boolean-mask assignment and ``F.avg_pool2d(x, x.shape[2:])``, through
``Trainer.fit`` under ``on_unsupported="error"`` (so nothing is gathered either)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_split_equals_one_process import STEPS, TileData, UserModule, _check_equal, make_data
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.spatial_checks import serial_sgd_fit

CLASSES = 3


class FormerRefusals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.same = nn.Conv2d(3, 4, 4, padding="same")  # even kernel: torch pads 1 before, 2 after
        self.bn = nn.SyncBatchNorm(4)
        self.across = nn.Conv2d(4, 4, (3, 1), padding=(1, 0))  # applied to the transposed activation
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        y = F.relu(self.bn(self.same(x)))
        y = self.across(y.transpose(2, 3)).transpose(2, 3)
        y[y < 0.1] = 0.05  # boolean-mask assignment
        pooled = F.avg_pool2d(y, y.shape[2:])  # a pooling window of the whole H x W
        return self.head(pooled.flatten(1))


class SpectralCheckpointed(nn.Module):
    """The hook form of ``spectral_norm`` (its weight computed from ``weight_orig`` before each call) and a
    block under the non-reentrant activation checkpoint; ``reentrant=True``: a plain convolution and the
    reentrant checkpoint, refused."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        conv = nn.Conv2d(3, 4, 3, padding=1)
        self.sn = conv if reentrant else nn.utils.spectral_norm(conv)  # the refusal alone, without spectral_norm
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(4, CLASSES)
        self.reentrant = reentrant

    def forward(self, x):
        y = F.relu(self.sn(x))
        y = checkpoint(self.block, y, use_reentrant=self.reentrant)
        return self.head(y.mean((2, 3)))


MODELS = {"former_refusals": FormerRefusals, "spectral_checkpointed": SpectralCheckpointed,
          "reentrant": lambda: SpectralCheckpointed(reentrant=True)}


def compute_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _split_run(rank, world, parts, name="former_refusals"):
    x, _, cls = make_data()
    torch.manual_seed(0)
    module = UserModule(MODELS[name]())
    strategy = SpatialParallelStrategy(spatial_parts=parts, on_unsupported="error")
    run = fit(module, datamodule=TileData(x, cls), devices=world, strategy=strategy, max_steps=STEPS, max_epochs=1,
              use_distributed_sampler=False, refusal_is_result=True, params=lambda m: m.model.parameters())
    if run.error is not None:  # reported, not raised: the message is the result
        return {"error": run.error, "steps": run.steps}
    module.eval()
    with torch.no_grad():
        out = module.model(x)  # a plain input: the layers run as one process (the eval output, replicated)
    return {"loss": run.metric("train_loss"), "grads": module.first_grads, "params": run.params, "out": out}


@pytest.mark.parametrize("name", ["former_refusals", "spectral_checkpointed"])
@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_former_refusals_equal_one_process(parts, name):
    x, _, cls = make_data()
    torch.manual_seed(0)
    ref = serial_sgd_fit(MODELS[name](), x, cls, compute_loss, 2, step_seed=100)
    for res in run_in_processes(_split_run, 2, parts, name, timeout_s=300, collective_timeout_s=60):
        _check_equal(res, ref, f"{name} at {parts[0]}x{parts[1]}")


@pytest.mark.slow
def test_former_refusals_equal_one_process_2x2():
    """4 ranks, 2x2 (uneven rows, H = 13): corners of the padded and transposed convolutions."""
    x, _, cls = make_data()
    refs = {}
    for name in ("former_refusals", "spectral_checkpointed"):
        torch.manual_seed(0)
        refs[name] = serial_sgd_fit(MODELS[name](), x, cls, compute_loss, 2, step_seed=100)
    for name in refs:
        for res in run_in_processes(_split_run, 4, (2, 2), name, timeout_s=600, collective_timeout_s=120):
            _check_equal(res, refs[name], f"{name} at 2x2", tol=5e-5)  # four partial sums per gradient


def test_reentrant_checkpoint_is_refused_naming_the_fix():
    """It ended in torch's shape mismatch in backward; now refused at the forward, before the first step."""
    for res in run_in_processes(_split_run, 2, (2, 1), "reentrant", timeout_s=300, collective_timeout_s=60):
        err = res.get("error")
        assert err is not None and "use_reentrant=True" in err and "Pass use_reentrant=False" in err, err
        assert "module 'model'" in err and res["steps"] == 0, err


def test_sync_batchnorm_with_several_sample_groups_is_refused():
    """Single process: with one sample group nn.SyncBatchNorm becomes a batch norm (converted, tiled); with two
    its statistics would span the other group's samples: refused at setup naming nn.BatchNorm2d."""
    from types import SimpleNamespace

    strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))
    strategy.layout = SimpleNamespace(num_sample_groups=2, grid=SimpleNamespace(ndim=2))
    with pytest.raises(ValueError, match="layer '1' is nn.SyncBatchNorm.*Use nn.BatchNorm2d"):
        strategy._sync_batchnorm_to_batchnorm(model)
    strategy.layout = SimpleNamespace(num_sample_groups=1, grid=SimpleNamespace(ndim=2))
    strategy._sync_batchnorm_to_batchnorm(model)
    assert type(model[1]) is nn.BatchNorm2d
    volume = nn.Sequential(nn.Conv3d(3, 4, 3), nn.SyncBatchNorm(4))  # volumes: the 3-D batch norm
    strategy.layout = SimpleNamespace(num_sample_groups=1, grid=SimpleNamespace(ndim=3))
    strategy._sync_batchnorm_to_batchnorm(volume)
    assert type(volume[1]) is nn.BatchNorm3d

"""Dropout under ``strategy="spatial"`` after the usual seeding: the user calls ``seed_everything(0)`` once, then
builds the model (drawing its initial weights), then ``Trainer.fit``.  Every rank must train exactly as one process
seeded the same way (``Trainer.fit`` on one device): the same dropout masks, so the same logged loss and parameters
(float64), and the generators at one process's state when training starts.  Ranks seeded differently after
building the model draw from rank 0's generator.

A 2-D U-Net with ``nn.Dropout`` and ``nn.Dropout2d`` split 2x1 and a 3-D one with ``nn.Dropout`` and
``nn.Dropout3d`` split 1x1x2, on the volume tests' data (:mod:`test_volumes`).
"""

from __future__ import annotations

import hashlib
import random

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import seed_everything
from test_volumes import BATCH, C_IN, CLASSES, N, SubVolumes
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

TOL = 1e-9  # float64


class DropoutUNet(nn.Module):
    """A small U-Net with dropout as a user writes one, for images (``dims=2``) or volumes (``dims=3``)."""

    def __init__(self, dims: int, width: int = 4) -> None:
        super().__init__()
        conv, pool, up = ((nn.Conv2d, nn.MaxPool2d, nn.ConvTranspose2d) if dims == 2 else
                          (nn.Conv3d, nn.MaxPool3d, nn.ConvTranspose3d))
        channel_dropout = nn.Dropout2d if dims == 2 else nn.Dropout3d
        w = width
        self.enc = nn.Sequential(conv(C_IN, w, 3, padding=1), nn.ReLU(), nn.Dropout(0.3))
        self.pool = pool(2, ceil_mode=True)
        self.mid = nn.Sequential(conv(w, 2 * w, 3, padding=1), nn.ReLU(), channel_dropout(0.5))
        self.up = up(2 * w, w, 2, stride=2)
        self.head = nn.Sequential(conv(2 * w, w, 3, padding=1), nn.ReLU(), nn.Dropout(0.2), conv(w, CLASSES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        u = self.up(self.mid(self.pool(e)))
        u = u[(..., *(slice(0, n) for n in e.shape[2:]))]  # one row too many along odd extents: crop to the skip
        return self.head(torch.cat([u, e], dim=1))


def _generators() -> str:
    """A digest of torch's, Python's and NumPy's global generator states (reading them draws nothing)."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    return h.hexdigest()


class DropoutSegmenter(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = DropoutUNet(3 if kind == "volume" else 2)
        self.losses: list[float] = []
        self.at_train_start = ""
        self.torch_at_train_start = torch.empty(0)

    def on_train_start(self) -> None:
        self.at_train_start = _generators()
        self.torch_at_train_start = torch.get_rng_state()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _run(rank: int, world: int, kind: str, parts: tuple[int, ...] | None, seed_per_rank: bool = False) -> dict:
    """The user's script: seed once, build the model, fit (one process where ``parts`` is None).
    ``seed_per_rank``: the script seeds torch again after building the model, with a seed of its own per process
    (``1000 + rank``), as launch scripts do that want different samples per process."""
    seed_everything(0)
    module = DropoutSegmenter(kind)
    if seed_per_rank:
        torch.manual_seed(1000 + rank)
    split = {} if parts is None else {"devices": world, "strategy": SpatialParallelStrategy(spatial_parts=parts),
                                      "use_distributed_sampler": False}
    run = fit(module, datamodule=SubVolumes(kind), max_epochs=2, precision="64-true", **split)
    return {"params": run.params, "losses": module.losses,
            "generators": module.at_train_start, "torch_generator": module.torch_at_train_start}


def _check(kind: str, parts: tuple[int, ...], seed_per_rank: bool = False) -> None:
    """``seed_per_rank``: one process is the script as rank 0 runs it."""
    (ref,) = run_in_processes(_run, 1, kind, None, seed_per_rank, timeout_s=300, collective_timeout_s=60)
    assert len(ref["losses"]) == 2 * N // BATCH
    results = run_in_processes(_run, 2, kind, parts, seed_per_rank, timeout_s=600, collective_timeout_s=120)
    for rank, res in enumerate(results):
        what = f"{kind} at {parts} rank {rank}"
        if seed_per_rank:  # torch's generator, which the model's random ops draw from, is rank 0's on every rank
            assert torch.equal(res["torch_generator"], ref["torch_generator"]), f"{what}: not rank 0's generator"
        else:
            assert res["generators"] == ref["generators"], f"{what}: the generators are not one process's at start"
        for step, (loss, r) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
            assert abs(loss - r) <= TOL * max(1.0, abs(r)), (what, step, loss, r)
        for k, (p, r) in enumerate(zip(res["params"], ref["params"], strict=True)):
            err = float((p - r).abs().max())
            assert err <= TOL, f"{what}: parameter {k} differs by {err:.3g}"


def test_2d_unet_with_dropout_split_2x1_trains_as_one_process_after_one_seed():
    _check("image", (2, 1))


def test_3d_unet_with_dropout_split_1x1x2_trains_as_one_process_after_one_seed():
    _check("volume", (1, 1, 2))


def test_ranks_seeded_differently_draw_rank_0s_masks():
    """Each tile keeps its part of a mask drawn on every rank: the ranks must draw from one state, rank 0's (the
    channels ``Dropout2d`` zeroes would otherwise differ from tile to tile)."""
    _check("image", (2, 1), seed_per_rank=True)

"""CNNs as users write them, trained through ``Trainer.fit`` with the ``lightning_hpc.KFAC`` callback (run by
``test_kfac_user_modules.py``, Lightning starts the other rank itself)::

    python user_modules_run.py DEVICES OUTDIR CASE [CASE ...]

With 2 devices (``strategy="ddp"``) rank ``r`` trains on shard ``r`` of every step's samples. With 1 device the
same step runs both shards as two accumulated micro-batches (``accumulate_grad_batches=2``): a BatchNorm then
normalises each half as the rank that owns it does, so the two runs are equal, float64, up to summation order.
Rank 0 writes ``OUTDIR/CASE.pt``: the trained parameters and the modules K-FAC registered.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_hpc import KFAC
from tests.fit_harness import fit

torch.set_num_threads(1)
WORLD, BATCH, STEPS = 2, 4, 4
KFAC_OPTIONS = {"factor_update_freq": 1, "inv_update_freq": 2, "damping": 0.01, "kl_clip": 0.01,
                "decomposition_dtype": "float64", "factor_dtype": "float64"}


class ShardBatches(Sampler[list[int]]):
    """Step ``k``'s batch of each shard in ``shards``: shard ``s`` holds the samples ``s, s + WORLD, ...``."""

    def __init__(self, shards: list[int]) -> None:
        self.shards = shards

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(STEPS):
            for s in self.shards:
                yield [s + WORLD * (k * BATCH + j) for j in range(BATCH)]

    def __len__(self) -> int:
        return STEPS * len(self.shards)


class UserModule(pl.LightningModule):
    """What every case shares: a mean cross-entropy, SGD with momentum and weight decay, and the data split."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.data = data

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(self.data, batch_sampler=ShardBatches([rank] if world == WORLD else list(range(WORLD))))


def _samples(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class UNet3D(UserModule):
    """A two-level 3-D U-Net: BatchNorm3d in the encoder, GroupNorm in the decoder, a ConvTranspose3d upsampling
    and a skip connection; voxel-wise cross-entropy."""

    def __init__(self) -> None:
        g = _samples(1)
        n = WORLD * BATCH * STEPS
        super().__init__(TensorDataset(torch.randn(n, 1, 6, 6, 6, generator=g, dtype=torch.float64),
                                       torch.randint(0, 2, (n, 6, 6, 6), generator=g)))
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU())
        self.down = nn.Sequential(nn.Conv3d(4, 8, 2, stride=2), nn.BatchNorm3d(8), nn.ReLU())
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv3d(8, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())
        self.head = nn.Conv3d(4, 2, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.head(self.dec(torch.cat([self.up(self.down(e)), e], dim=1)))


def _separable(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    """MobileNet's depthwise-separable block: a depthwise 3x3 and a pointwise 1x1, each with BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_in, 3, stride=stride, padding=1, groups=c_in, bias=False), nn.BatchNorm2d(c_in),
        nn.ReLU6(), nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU6(),
    )  # fmt: skip


class MobileNetLike(UserModule):
    def __init__(self) -> None:
        g = _samples(2)
        n = WORLD * BATCH * STEPS
        super().__init__(TensorDataset(torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
                                       torch.randint(0, 3, (n,), generator=g)))
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU6(),
            _separable(6, 8, 1), _separable(8, 12, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Linear(12, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SignalNet(UserModule):
    """Conv1d layers over a 2-channel signal (an InstanceNorm1d with affine parameters, a strided dilated layer)."""

    def __init__(self) -> None:
        g = _samples(3)
        n = WORLD * BATCH * STEPS
        super().__init__(TensorDataset(torch.randn(n, 2, 32, generator=g, dtype=torch.float64),
                                       torch.randint(0, 3, (n,), generator=g)))
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Conv1d(2, 6, 5, padding=2), nn.InstanceNorm1d(6, affine=True), nn.ReLU(),
            nn.Conv1d(6, 8, 3, stride=2, dilation=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
            nn.Linear(8, 3),
        )  # fmt: skip
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TextClassifier(UserModule):
    """Token ids -> Embedding -> LayerNorm -> a position-wise MLP -> mean over the sequence -> classes."""

    def __init__(self) -> None:
        g = _samples(4)
        n = WORLD * BATCH * STEPS
        super().__init__(TensorDataset(torch.randint(0, 40, (n, 10), generator=g),
                                       torch.randint(0, 3, (n,), generator=g)))
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 12, padding_idx=0)
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 12))
        self.out = nn.Linear(12, 3)
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        return self.out((h + self.mlp(h)).mean(dim=1))


CASES = {"unet3d": UNet3D, "mobilenet": MobileNetLike, "signal": SignalNet, "text": TextClassifier}


def run(devices: int, outdir: Path, case: str) -> None:
    module = CASES[case]()
    kfac = KFAC(**KFAC_OPTIONS)
    done = fit(module, devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=STEPS,
               accumulate_grad_batches=WORLD // devices, use_distributed_sampler=False, callbacks=[kfac])
    if done.trainer.global_rank == 0:
        assert kfac.preconditioner is not None
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        registered = [(n, t) for n, t, _ in kfac.preconditioner.preconditioned_modules]
        pre = kfac.preconditioner
        torch.save({"params": params, "registered": registered, "steps": pre.steps,
                    "handlers": [h.name for h in pre.handlers], "factored": list(pre.factors),
                    "decomposed": list(pre.decompositions)}, outdir / f"{case}.pt")


if __name__ == "__main__":
    devices, outdir = int(sys.argv[1]), Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[3:]:
        run(devices, outdir, name)

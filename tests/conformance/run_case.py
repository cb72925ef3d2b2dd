"""One Trainer.fit of a conformance case, as a user would write it (launched by test_*.py; Lightning starts the
other ranks itself).  ``python run_case.py CASE STRATEGY DEVICES OUT.ckpt``: the final checkpoint goes to OUT.

The data are sharded by Lightning's own DistributedSampler (which shuffles training data with seed 0); with
``devices=1`` the loader's batches are, step by step, the union of what the ranks see: the reference.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_hpc  # noqa: F401  makes the strategy names known to Lightning

torch.set_num_threads(1)
WORLD, B, N, CLIP = 2, 4, 64, 0.05
STEPS = 4


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(F.relu(self.conv(x))), 1)


class UserCNN(pl.LightningModule):
    """A user's classifier: the model at ``self.model``, a plain mean cross-entropy, SGD with momentum."""

    def __init__(self, manual_clip: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(Backbone(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3)).double()
        self.automatic_optimization = not manual_clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        if not self.automatic_optimization:  # manual optimization with clipping, as Lightning's docs show
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)


class AdamCNN(UserCNN):
    """The same module trained with AdamW (adaptive: any gradient difference is amplified, not averaged away)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=1e-2)


class BackboneClassifier(UserCNN):
    """The same network as ``self.backbone`` + ``self.classifier`` (no ``.model`` attribute)."""

    def __init__(self) -> None:
        super().__init__()
        del self.model
        torch.manual_seed(0)
        self.backbone = Backbone().double()
        self.classifier = nn.Sequential(nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))


def boring_model() -> pl.LightningModule:
    from lightning.pytorch.demos.boring_classes import BoringModel

    torch.manual_seed(0)
    return BoringModel()


def flatten_linear() -> UserCNN:
    module = UserCNN()
    torch.manual_seed(0)
    module.model = nn.Sequential(nn.Flatten(), nn.Linear(72, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    return module


def ode_net() -> UserCNN:
    """A user's module holding a deep ODE-ResNet (the form the multigrid strategy trains) at ``self.model``."""
    from lightning_hpc.models import ode_resnet

    module = UserCNN()
    torch.manual_seed(0)
    module.model = ode_resnet(in_channels=2, num_classes=3, input_size=(6, 6), width=4, num_steps=8).double()
    return module


class UnusedTrunkParameter(UserCNN):
    """A trunk layer that takes no part in the loss (a common leftover in users' models)."""

    def __init__(self) -> None:
        super().__init__()
        self.model[0].unused = nn.Conv2d(4, 4, 1).double()


CASES = {
    # name: (module factory, Trainer kwargs)
    "clip_norm": (lambda: UserCNN(), {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}),
    "clip_value": (lambda: UserCNN(), {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "manual_clip": (lambda: UserCNN(manual_clip=True), {}),
    "backbone_classifier": (BackboneClassifier, {}),
    "boring_model": (boring_model, {}),  # Lightning's own demo module, with its own data
    "flatten_linear": (flatten_linear, {}),
    "odenet": (ode_net, {}),
    "predict": (UserCNN, {}),
    "adamw": (AdamCNN, {}),
    "accumulate_2": (lambda: UserCNN(), {"accumulate_grad_batches": 2}),
    "unused_parameter": (UnusedTrunkParameter, {}),  # trainer.predict with Lightning's own (unpadded) predict sampler
    "odenet_bf16_mixed": (ode_net, {"precision": "bf16-mixed"}),
    "odenet_clip_norm": (ode_net, {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}),
}


class ReportSteps(pl.Callback):
    """Prints a line at every optimizer step, so a test can tell a refusal before the first step from a failure
    during training."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        print(f"OPTIMIZER STEP {trainer.global_step} on rank {trainer.global_rank}", flush=True)


def build_strategy(name: str) -> object:
    """A strategy by name; ``multigrid_pm``: the multigrid strategy's partitioned model (layer-sharded trunk,
    serial evaluation: exact)."""
    if name == "hybrid_fc_find_unused":
        from lightning_hpc import HybridParallelStrategy

        return HybridParallelStrategy(find_unused_parameters=True)
    if name == "multigrid_pm":
        from lightning_hpc import MultigridStrategy

        return MultigridStrategy(mode="pm", log_residuals=False)
    return name


def main(case: str, strategy: str, devices: int, out: str, data_parallel: int = WORLD) -> None:
    factory, kwargs = CASES[case]
    module = factory()
    data = images()
    if devices == 1:  # the reference: global batch b = the union of every data-parallel rank's batch b
        shards = [list(DistributedSampler(data, data_parallel, r, shuffle=True, seed=0)) for r in range(data_parallel)]
        batches = [[i for shard in shards for i in shard[b * B : (b + 1) * B]] for b in range(len(shards[0]) // B)]
        loader = DataLoader(data, batch_sampler=batches)
    else:
        loader = DataLoader(data, batch_size=B)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=build_strategy(strategy), max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ReportSteps()],
        **kwargs,
    )
    if case == "predict":
        trainer.predict(module, loader)
        return
    trainer.fit(module, None if case == "boring_model" else loader)
    trainer.save_checkpoint(out)


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:]))

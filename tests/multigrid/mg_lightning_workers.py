"""Lightning runs of MultigridStrategy for the spawned-process tests (module-level: picklable)."""

from __future__ import annotations

import torch

STEPS, BATCH, NUM_STEPS = 2, 8, 16
STRATEGY = dict(cfactor=4, levels=2, relaxation="F", forward_cycles=2, backward_cycles=2)


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(steps * BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (steps * BATCH,), generator=g)


def fit(rank: int, world_size: int, max_steps: int, save_path: str, resume_path: str | None = None) -> dict:
    """Train a 16-step ODE-ResNet with ``layer_parallel_size = world_size`` for ``max_steps`` optimizer steps
    (from ``resume_path`` if given) on fixed batches, save a checkpoint; report what the optimizer holds."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import ImageClassifier, MultigridStrategy
    from lightning_hpc.models import ode_resnet

    torch.manual_seed(0)
    module = ImageClassifier(ode_resnet(num_steps=NUM_STEPS, width=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    loader = DataLoader(TensorDataset(*data(max_steps)), batch_size=BATCH, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=MultigridStrategy(layer_parallel_size=world_size, **STRATEGY),
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume_path)
    trainer.save_checkpoint(save_path)
    opt = trainer.optimizers[0]
    return {
        "trunk_numel": sum(p.numel() for p in module.model.steps.parameters()),
        "optimizer_numel": sum(p.numel() for g in opt.param_groups for p in g["params"]),
        "momentum_numel": sum(s["momentum_buffer"].numel() for s in opt.state.values()),
    }

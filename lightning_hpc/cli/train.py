"""Hydra entry: compose a recipe, instantiate everything with ``_target_``, run ``Trainer.fit``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_hpc.modules.classification import ImageClassifier

__all__ = ["build", "run"]


def _instantiate_mapping(cfg: DictConfig | None) -> list[Any]:
    """Instantiate every non-null entry of a name -> config mapping (callbacks, loggers)."""
    if not cfg:
        return []
    return [instantiate(node) for node in cfg.values() if node is not None]


def _strategy(cfg: Any) -> Any:
    if cfg is None or isinstance(cfg, str):
        return cfg or "auto"
    return instantiate(cfg)


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule]:
    """Build (trainer, module, datamodule) from a composed recipe config. Pure construction: no training."""
    pl.seed_everything(cfg.get("seed", 0), workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    # scheduler=none leaves only the recipe's schedule numbers (no _target_): no scheduler then.
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") and cfg.scheduler.get("_target_") else None
    # a config mapping converts to a dict (of keyword arguments: str keys)
    task = cast(dict[str, Any], OmegaConf.to_container(cfg.task, resolve=True)) if cfg.get("task") else {}
    module_target = task.pop("_target_", None)
    if module_target is not None:
        module = instantiate({"_target_": module_target, **task}, model=model, optimizer=optimizer, scheduler=scheduler)
    else:
        module = ImageClassifier(model=model, optimizer=optimizer, scheduler=scheduler, **task)
    plugins = []
    trainer_kwargs = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))
    precision = cfg.get("precision")
    if isinstance(precision, (str, int)):
        trainer_kwargs["precision"] = precision
    elif precision is not None:
        plugins.append(instantiate(precision))
    trainer = pl.Trainer(
        **trainer_kwargs,
        strategy=_strategy(cfg.get("strategy")),
        callbacks=_instantiate_mapping(cfg.get("callbacks")),
        logger=_instantiate_mapping(cfg.get("logger")) or False,
        plugins=plugins or None,
    )
    return trainer, module, datamodule


def _summary(trainer: pl.Trainer) -> dict[str, Any]:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    ckpt = trainer.checkpoint_callback
    return {
        "metrics": metrics,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "log_dirs": [lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)],
        "checkpoint": getattr(ckpt, "best_model_path", None) or getattr(ckpt, "last_model_path", None) or None,
    }


def _reset_distributed(env_before: dict[str, str]) -> None:
    """Leave the process as it was before the job, so the next job of a ``--multirun`` sweep launches its
    own ranks: Lightning keeps the process group and the launcher's variables (LOCAL_RANK, MASTER_PORT, ...)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env_before):
        del os.environ[key]
    os.environ.update(env_before)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train the recipe; on global rank 0 print and write (``metrics.json``) the final metrics and paths."""
    env_before = dict(os.environ)
    try:
        trainer, module, datamodule = build(cfg)
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        summary = _summary(trainer)
    finally:
        _reset_distributed(env_before)
    if trainer.is_global_zero:
        out = Path(trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(summary, indent=2))
        lines = [f"  {k} = {v:.4f}" for k, v in sorted(summary["metrics"].items())]
        print("\nFinal metrics:\n" + "\n".join(lines))
        print(f"Logs: {', '.join(summary['log_dirs']) or '(no logger)'}")
        print(f"Checkpoint: {summary['checkpoint'] or '(none saved)'}")
        print(f"Run directory: {os.path.abspath(out)}")
    return summary

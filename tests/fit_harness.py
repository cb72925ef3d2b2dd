"""The one harness through which tests train with Lightning's ``Trainer``.

Every test that trains through ``Trainer`` builds it with :func:`trainer` (quiet: no logger, checkpoints, bars or
model summary unless the test asks; on the CPU) and, where it trains once and reads the outcome, calls :func:`fit`,
which returns one picklable record (:class:`Fit`): the parameters after training, the logged metrics, the steps
taken, the refusal's message where the test expects one, and the warnings given.  A rank started by
``run_in_processes`` returns that record as it is (the module and trainer stay behind on the rank).  A change of
harness (a Lightning default, a field every test reads) is one edit here.

End-to-end "trains as one process" properties across strategies and Lightning features are owned by the
conformance matrix (``tests/conformance``); tests elsewhere use this harness to check one mechanism each."""

from __future__ import annotations

import warnings as warnings_module
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

#: Lightning's output a test does not read: off unless the test names it.
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def trainer(*, devices: int = 1, strategy: Any = "auto", accelerator: str = "cpu", **options: Any) -> pl.Trainer:
    """A quiet ``pl.Trainer`` on ``devices`` CPU processes; ``options`` are Trainer arguments and win over
    :data:`QUIET` (``logger=CSVLogger(...)`` turns logging back on)."""
    return pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, **{**QUIET, **options})


@dataclass
class Fit:
    """What one ``Trainer.fit`` left: picklable, so a rank returns it as it is."""

    params: list[torch.Tensor]
    metrics: dict[str, torch.Tensor]
    steps: int
    epoch: int = 0
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: the module and trainer after the run, on the process that ran it (``None`` once the record was pickled)
    module: pl.LightningModule | None = None
    trainer: pl.Trainer | None = None

    def metric(self, name: str = "train_loss") -> float:
        """A logged scalar, as a float (a missing one names what was logged)."""
        if name not in self.metrics:
            raise KeyError(f"{name!r} was not logged; logged: {sorted(self.metrics)}")
        return float(self.metrics[name])

    def warned(self, containing: str) -> list[str]:
        """The warnings given during the run whose message contains ``containing``."""
        return [w for w in self.warnings if containing in w]

    def __getstate__(self) -> dict[str, Any]:
        # a Trainer holds its strategy's process groups and data loaders: it stays on the rank that made it
        return {**self.__dict__, "module": None, "trainer": None}


def fit(
    module: pl.LightningModule,
    train_dataloaders: Any = None,
    *,
    datamodule: pl.LightningDataModule | None = None,
    devices: int = 1,
    strategy: Any = "auto",
    refusal_is_result: bool = False,
    record_warnings: bool = False,
    params: Callable[[pl.LightningModule], Iterable[torch.nn.Parameter]] | None = None,
    ckpt_path: str | None = None,
    **options: Any,
) -> Fit:
    """Train ``module`` once through a quiet :func:`trainer` and return what the run left.

    ``refusal_is_result``: an exception raised by ``fit`` is returned as ``Fit.error`` (``"Type: message"``) with the
    steps taken before it, for tests whose expected outcome is a refusal; otherwise it propagates.
    ``record_warnings``: every warning given during the run is kept in ``Fit.warnings`` (always shown).
    ``params``: which parameters to return (default: all of the module's, in order); ``ckpt_path``: resume from
    that checkpoint, as ``Trainer.fit`` does."""
    run = trainer(devices=devices, strategy=strategy, **options)
    caught: list[warnings_module.WarningMessage] = []
    error = None
    with warnings_module.catch_warnings(record=record_warnings) as recorded:
        if record_warnings:
            warnings_module.simplefilter("always")
        try:
            run.fit(module, train_dataloaders=train_dataloaders, datamodule=datamodule, ckpt_path=ckpt_path)
        except Exception as e:  # noqa: BLE001 - returned, not raised, only where the test expects a refusal
            if not refusal_is_result:
                raise
            error = f"{type(e).__name__}: {e}"
        if record_warnings:
            caught = list(recorded or [])
    chosen = module.parameters() if params is None else params(module)
    return Fit(
        params=[p.detach().clone() for p in chosen],
        metrics={k: v.detach().clone() for k, v in run.callback_metrics.items()},
        steps=run.global_step,
        epoch=run.current_epoch,
        error=error,
        warnings=[str(w.message) for w in caught],
        module=module,
        trainer=run,
    )

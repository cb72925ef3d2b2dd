"""K-FAC's options from LightningCLI's command line reach the preconditioner (``--trainer.callbacks+=`` then the
callback's own keys), and a misspelt option is refused by the parser with the option's name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jsonargparse")

from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel  # noqa: E402

from lightning_hpc import KFAC  # noqa: E402


def _cli(*args: str) -> LightningCLI:
    return LightningCLI(BoringModel, BoringDataModule, args=["fit", *args], save_config_callback=None)


def test_cli_options_reach_the_preconditioner(tmp_path):
    cli = _cli(
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_hpc.KFAC", "--trainer.callbacks.damping=0.01",
        "--trainer.callbacks.inv_update_freq=7", "--trainer.callbacks.kl_clip=null",
        "--trainer.callbacks.decomposition_dtype=float64", "--trainer.callbacks.skip_layers=[conv,head]",
    )
    kfac = next(c for c in cli.trainer.callbacks if isinstance(c, KFAC))
    pre = kfac.preconditioner
    assert pre is not None and pre.steps == 2  # it ran the two steps
    assert pre.options.damping == 0.01 and pre.options.inv_update_freq == 7 and pre.kl_clip is None
    assert pre.decomposition_dtype == torch.float64 and pre.options.skip_layers == ("conv", "head")


def test_cli_refuses_a_misspelt_option(capsys):
    with pytest.raises(SystemExit):
        _cli("--trainer.callbacks+=lightning_hpc.KFAC", "--trainer.callbacks.dampin=0.01")
    assert "dampin" in capsys.readouterr().err

"""``lightning-hpc``: the command line (train recipes with Hydra; planning and data tools) and its Hydra glue."""

from lightning_hpc.cli.main import main

__all__ = ["main"]

"""The digits recipe runs with strategy=layered_sgd through the CLI (2 processes as 2 node groups of 1; rank 0 in the
test's process, ``cli_in_process``)."""

from __future__ import annotations

import json


def test_digits_recipe_fast_dev_run(cli_in_process):
    cli_in_process(
        "train", "recipe=digits", "strategy=layered_sgd",
        "strategy.procs_per_node=1",  # 2 groups: exercises the leaders' allreduce on the communicator thread
        "trainer.fast_dev_run=true", f"hydra.run.dir={cli_in_process.cwd}",
    )  # fmt: skip
    summary = json.loads((cli_in_process.cwd / "metrics.json").read_text())
    assert summary["global_step"] == 1
    assert "val/loss" in summary["metrics"]


def test_bad_topology_fails_before_training(cli_in_process):
    """World 6 with procs_per_node=4 is rejected when the Trainer is built, before any process starts."""
    proc = cli_in_process(
        "train", "recipe=digits", "strategy=layered_sgd", "strategy.procs_per_node=4", "trainer.devices=6",
        "trainer.fast_dev_run=true", f"hydra.run.dir={cli_in_process.cwd}", check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "world size 6 is not divisible by procs_per_node=4" in proc.stdout
    assert not (cli_in_process.cwd / "metrics.json").exists()
    assert "Initializing distributed" not in proc.stdout

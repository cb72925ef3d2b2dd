"""`lightning-hpc train`: last.ckpt is the final state and resuming from it continues; numeric group options
(`precision=32`); `--help` lists the configuration groups."""

import torch

from lightning_hpc.cli.main import _quote_numeric_groups
from tests.conftest import read_metrics, run_dirs

SHORT = ["trainer.devices=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=2",
         "trainer.enable_progress_bar=false", "scheduler=none"]


def _step(path) -> tuple[int, int]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["global_step"], ckpt["epoch"]


def test_last_ckpt_is_the_final_state_when_the_metric_stops_improving_and_resume_continues(cli_in_process):
    cli = cli_in_process
    # lr=0: val/acc never improves after epoch 0, so the monitored checkpoint is written once (step 2); with
    # Lightning's save_last on that checkpoint, last.ckpt stayed at step 2 while training went on to step 6.
    # Run folders named here: the default names are by the second, and two runs in one process can share one
    cli("train", *SHORT, "optimizer.lr=0.0", "trainer.max_epochs=3", "hydra.run.dir=outputs/digits/1")
    (run,) = run_dirs(cli.cwd, "digits")
    assert read_metrics(run)["global_step"] == 6
    assert _step(run / "checkpoints" / "last.ckpt") == (6, 2), "last.ckpt must hold the last completed epoch"
    best = [p for p in (run / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt"]
    assert [p.name for p in best] == ["epoch=0-step=2.ckpt"], best
    # Resuming continues after epoch 2: one more epoch (2 steps), not a repeat of epochs 1-2.
    cli("train", *SHORT, "optimizer.lr=0.0", "trainer.max_epochs=4", f"ckpt_path={run}/checkpoints/last.ckpt",
        "hydra.run.dir=outputs/digits/2")
    resumed = run_dirs(cli.cwd, "digits")[-1]
    m = read_metrics(resumed)
    assert (m["epochs"], m["global_step"]) == (4, 8), m
    assert _step(resumed / "checkpoints" / "last.ckpt") == (8, 3)


def test_precision_32_is_a_group_option_not_an_int():
    # runs with precision=32 on two processes (the rank Lightning re-launches gets the override too):
    # test_cli.py::test_multirun_sweep_with_two_processes_keeps_one_folder_per_job_and_overrides_take_effect
    assert _quote_numeric_groups(["precision=32", "+precision=16", "optimizer.lr=1", "x=2"], {"precision"}) == [
        "precision='32'", "+precision='16'", "optimizer.lr=1", "x=2"]


def test_help_lists_the_configuration_groups(cli_in_process):
    out = cli_in_process("train", "--help").stdout
    groups = out.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    for line in ("precision: 16-mixed, 32,", "strategy: auto, ddp, horovod, hybrid_fc, layered_sgd, multigrid, spatial",
                 "callbacks: default, kfac"):
        assert line in groups, groups

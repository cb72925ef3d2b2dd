"""End-to-end runs of ``lightning-hpc train`` (Hydra composition, DDP children, outputs, sweeps; resume: see
test_cli_resume_and_help.py).  The command runs in the test's process (``cli_in_process``: Lightning is imported
already), its other ranks as ``python -m lightning_hpc train`` children, as Lightning starts them under the installed
command."""

import csv
import runpy
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_hpc.cli.config_paths import conf_dir, recipe_names, recipes_dir
from lightning_hpc.cli.main import _hydra_argv
from tests.conftest import read_metrics, run_dirs

#: per-recipe overrides that keep a fast_dev_run cheap on 2 CPU cores (every recipe must be listed)
FAST = {
    # the default recipe on 2 processes: wiring by the sweep (default tier), its full run by the 97 % test (slow tier)
    "digits": "test_multirun_sweep_with_two_processes_keeps_one_folder_per_job_and_overrides_take_effect",
    "resnet_cifar": [
        "batch_size=8",
        "data.num_workers=0",
        "data.synthetic_train_size=64",
        "data.synthetic_val_size=16",
        "model.depth=20",
    ],
    "resnet_imagenet": ["data=synthetic", "batch_size=2", "model.depth=18", "data.train_size=8", "data.val_size=4"],
    "alexnet_imagenet": [
        "batch_size=2",
        "model.fc_width=64",
        "data.train_size=8",
        "data.val_size=4",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
    ],
    # run by the test named here (with their own size overrides or further checks)
    "digits_odenet": "tests/multigrid/test_multigrid_strategy.py",
    "mesh_tangling_1k": "tests/mesh_tangling/test_recipes.py",
    "mesh_tangling_2k": "tests/mesh_tangling/test_recipes.py",
    "volumes_unet3d": "tests/spatial/lightning/test_volume_recipe.py",
}


def test_every_recipe_is_covered_by_the_fast_dev_run_sweep():
    missing = set(recipe_names()) - set(FAST)
    assert not missing, f"add fast_dev_run overrides for {sorted(missing)} to tests/test_cli.py::FAST"


@pytest.mark.parametrize("recipe", recipe_names())
def test_recipe_composes_and_objects_are_targets(recipe):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        cfg = compose(config_name=recipe, overrides=[f"hydra.searchpath=[file://{conf_dir()}]"])
    for group in ("model", "data", "trainer"):
        assert group in cfg, f"{recipe} lacks {group}"
    assert "_target_" in cfg.model and "_target_" in cfg.data
    OmegaConf.to_container(cfg.model, resolve=True)  # interpolations resolve


@pytest.mark.slow  # a result of training, not of wiring: digits recipe wiring is test_recipe_fast_dev_run's
def test_default_recipe_trains_digits_to_97_percent_on_two_processes(cli_in_process):
    # precision=32 is the recipe's own (a numeric group option: the rank Lightning re-launches must get it quoted)
    proc = cli_in_process("train", "precision=32", "trainer.enable_progress_bar=false")
    assert "MEMBER: 2/2" in proc.stdout, "the default recipe must run 2 DDP processes"
    (run,) = run_dirs(cli_in_process.cwd, "digits")
    m = read_metrics(run)
    assert m["metrics"]["val/acc"] >= 0.97, m
    assert "Final metrics" in proc.stdout and "Checkpoint:" in proc.stdout
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert list(run.glob("tensorboard/version_0/events.*")) and list(run.glob("csv/version_0/metrics.csv"))


@pytest.mark.parametrize("recipe", sorted(FAST))
def test_recipe_fast_dev_run(cli_in_process, recipe):
    if recipe not in recipe_names():
        pytest.skip(f"recipe {recipe} not shipped")
    if isinstance(FAST[recipe], str):
        pytest.skip(f"covered by {FAST[recipe]}")
    cli_in_process("train", f"recipe={recipe}", "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false",
                   *FAST[recipe])


@pytest.mark.slow  # seconds of 2 ranks per job; the default tier composes multirun commands (test_docs_snippets.py)
def test_multirun_sweep_with_two_processes_keeps_one_folder_per_job_and_overrides_take_effect(cli_in_process):
    # resuming from last.ckpt through the CLI is owned by test_cli_resume_and_help.py (exact steps and epochs);
    # resuming under DDP through Trainer.fit by the conformance matrix's ddp:resume cell
    proc = cli_in_process(
        "train",
        "precision=32",  # a numeric group option: the rank Lightning re-launches must get it quoted
        "trainer.max_epochs=2",
        "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=1",
        "scheduler=none",
        "trainer.enable_progress_bar=false",
        "--multirun",
        "optimizer.lr=0.01,0.02",
    )
    assert proc.stdout.count("MEMBER: 2/2") == 2
    (sweep,) = (cli_in_process.cwd / "multirun" / "digits").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"], jobs
    assert not (cli_in_process.cwd / "outputs").exists(), "children must write into the job folder, not a new run dir"
    for job, lr in zip(jobs, (0.01, 0.02)):
        assert read_metrics(sweep / job)["epochs"] == 2
        with open(sweep / job / "csv" / "version_0" / "metrics.csv") as f:
            lrs = {float(r["lr-SGD"]) for r in csv.DictReader(f) if r.get("lr-SGD")}
        assert lrs == {lr}, f"job {job}"


def test_missing_imagenet_folder_fails_before_training(cli_in_process, tmp_path):
    proc = cli_in_process(
        "train", "recipe=resnet_imagenet", f"data.root={tmp_path}/nope", "trainer.fast_dev_run=true", check=False
    )
    assert proc.returncode != 0
    assert f"{tmp_path}/nope" in proc.stdout and "data=synthetic" in proc.stdout
    assert "Epoch 0" not in proc.stdout


def test_unknown_recipe(monkeypatch, capsys):
    # `python -m lightning_hpc train recipe=nope`, its module run here: the exit code reaches the process
    monkeypatch.setattr(sys, "argv", ["lightning-hpc", "train", "recipe=nope"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("lightning_hpc", run_name="__main__")
    assert exited.value.code == 2 and "available: " in capsys.readouterr().err


def test_hydra_argv_keeps_overrides_in_one_run():
    assert _hydra_argv(["--multirun", "a=1,2", "-cn", "x", "b=3"], ["s=1"]) == [
        "s=1",
        "a=1,2",
        "b=3",
        "--multirun",
        "-cn",
        "x",
    ]


def test_cfg_job_prints_the_composed_config_with_its_value_apart(monkeypatch, capsys):
    """``lightning-hpc train --cfg job recipe=digits`` as ``train --help`` shows Hydra's ``--cfg {job,hydra,all}``:
    the value given apart stays next to its flag (it was taken for an override: "expected one argument")."""
    assert _hydra_argv(["--cfg", "job", "a=1", "-p", "trainer"], []) == ["a=1", "--cfg", "job", "-p", "trainer"]
    monkeypatch.setattr(sys, "argv", ["lightning-hpc", "train", "--cfg", "job", "recipe=digits"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("lightning_hpc", run_name="__main__")
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    assert "trainer:" in out and "max_epochs" in out, out[-2000:]

"""K-FAC through the command line: Hydra recipes with callbacks=kfac (``lightning-hpc train`` in the test's process,
``cli_in_process``), and plan-kfac."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from lightning_hpc.cli import plan_kfac as plan_mod
from lightning_hpc.cli.config_paths import conf_dir, recipes_dir


def _compose(recipe: str, *overrides: str):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return compose(
            config_name=recipe,
            overrides=[f"hydra.searchpath=[file://{conf_dir()}]", *overrides],
            return_hydra_config=True,
        )


@pytest.mark.parametrize(
    "recipe,epochs,milestones,damping,inv_freq",
    [("resnet_cifar", 100, [35, 75, 90], 0.003, 10), ("resnet_imagenet", 55, [25, 35, 40, 45, 50], 0.001, 500)],
)
def test_recipes_pick_the_kfac_schedule(recipe, epochs, milestones, damping, inv_freq):
    cfg = _compose(recipe, "callbacks=kfac")
    assert cfg.trainer.max_epochs == epochs and list(cfg.scheduler.milestones) == milestones
    assert cfg.scheduler.warmup_epochs == 5
    assert cfg.callbacks.kfac._target_ == "lightning_hpc.KFAC"
    assert cfg.callbacks.kfac.damping == damping and cfg.callbacks.kfac.inv_update_freq == inv_freq
    assert "checkpoint" in cfg.callbacks  # the default callbacks stay
    sgd = _compose(recipe)
    assert "kfac" not in sgd.callbacks and sgd.trainer.max_epochs != epochs


def test_resnet_cifar_kfac_fast_dev_run(cli_in_process):
    cli_in_process(
        "train",
        "recipe=resnet_cifar",
        "callbacks=kfac",
        "trainer.fast_dev_run=true",
        "trainer.enable_progress_bar=false",
        "batch_size=8",
        "data.num_workers=0",
        "data.synthetic_train_size=64",
        "data.synthetic_val_size=16",
        "model.depth=20",
    )


def test_digits_kfac_two_ddp_processes_checkpoint_holds_kfac_state(cli_in_process):
    proc = cli_in_process(
        "train", "callbacks=kfac", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
        "callbacks.kfac.inv_update_freq=5", "callbacks.kfac.damping=0.003",
    )
    assert "MEMBER: 2/2" in proc.stdout
    (run,) = sorted((cli_in_process.cwd / "outputs" / "digits").iterdir())
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("KFAC")]
    assert state["steps"] == ckpt["global_step"] > 0
    # the convolutions and the Linear, and the BatchNorm layers' affine parameters
    assert set(state["factors"]) == {"model.0", "model.1", "model.3", "model.4", "model.7", "model.8", "model.13"}
    assert set(state["decompositions"]) == set(state["factors"])
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    assert cfg["callbacks"]["kfac"]["inv_update_freq"] == 5


def test_plan_kfac_json_round_robin_resnet50(capsys):
    # the paper's figures count its layer types (Linear and convolutions), not the BatchNorm layers' blocks
    assert plan_mod.main(["--model", "resnet50", "--world-size", "16", "--placement", "round_robin", "--json",
                          "--layer-types", "linear", "conv"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["layers"] == 54 and len(p["ranks"]) == 16
    assert sum(len(r["factors"]) for r in p["ranks"]) == 108
    numel = [r["numel"] for r in p["ranks"]]
    # Section VI-C4 reports 1.46e6 .. 2.83e7 parameters per worker for ResNet-50 on 16 GPUs (round robin).
    assert min(numel) == pytest.approx(1.46e6, rel=0.01) and max(numel) == pytest.approx(2.83e7, rel=0.01)
    costs = [r["cost"] for r in p["ranks"]]
    assert p["max_cost"] == max(costs) and p["mean_cost"] == pytest.approx(sum(costs) / 16)
    assert p["lower_bound_cost"] >= p["mean_cost"]


def test_plan_kfac_table_and_errors(capsys):
    assert plan_mod.main(["--model", "cifar_resnet32", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "placement balanced" in out and "max / lower bnd" in out and out.count("\n") > 6
    with pytest.raises(SystemExit):
        plan_mod.main(["--model", "nope"])
    with pytest.raises(SystemExit):
        plan_mod.main(["--world-size", "0"])
    with pytest.raises(SystemExit):
        plan_mod.main(["--placement", "random"])


def test_kaisa_and_storage_options_compose_to_the_callback():
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = _compose("resnet_cifar", "callbacks=kfac", "callbacks.kfac.grad_worker_fraction=0.5",
                   "callbacks.kfac.factor_dtype=bfloat16", "callbacks.kfac.inverse_dtype=float16")
    kfac = instantiate(cfg.callbacks.kfac)
    assert kfac.options.grad_worker_fraction == 0.5
    assert kfac.options.torch_factor_dtype == torch.bfloat16 and kfac.options.torch_inverse_dtype == torch.float16
    with pytest.raises(InstantiationException, match=r"grad_worker_fraction must be in \(0, 1\]"):  # before training
        instantiate(
            _compose("resnet_cifar", "callbacks=kfac", "callbacks.kfac.grad_worker_fraction=1.5").callbacks.kfac
        )


def test_kfac_fp16_precision_option_composes_to_the_plugin():
    cfg = _compose("resnet_imagenet", "callbacks=kfac", "precision=kfac_16-mixed")
    assert cfg.precision._target_ == "lightning_hpc.KFACMixedPrecision" and cfg.precision.precision == "16-mixed"

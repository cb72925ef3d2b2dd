"""The mesh tangling recipes through ``lightning-hpc train`` (``cli_in_process``: rank 0 in the test's process, rank 1
a ``python -m lightning_hpc train`` child), fast_dev_run on small inputs."""

import pytest


def _fast_dev_run(cli_in_process, recipe, devices, *extra):
    proc = cli_in_process(
        "train", f"recipe={recipe}", "trainer.fast_dev_run=true", "input_shape=[18,128,128]", "data.train_samples=2",
        "data.val_samples=1", "trainer.accelerator=cpu", f"trainer.devices={devices}",
        f"hydra.run.dir={cli_in_process.cwd}", *extra,
    )  # fmt: skip
    assert "val/iou" in proc.stdout and "train/loss" in proc.stdout
    return proc.stdout


# the mesh recipes run in the slow tier (each is seconds of 2 ranks at 128^2); the default tier runs the spatial
# strategy through `lightning-hpc train` on the volumes recipe (tests/spatial/lightning/test_volume_recipe.py)
@pytest.mark.slow
def test_mesh_tangling_1k_fast_dev_run_ddp(cli_in_process):
    _fast_dev_run(cli_in_process, "mesh_tangling_1k", devices=2)


@pytest.mark.slow
def test_mesh_tangling_2k_fast_dev_run_ddp(cli_in_process):
    _fast_dev_run(cli_in_process, "mesh_tangling_2k", devices=2)


@pytest.mark.slow
def test_mesh_tangling_1k_fast_dev_run_spatial_tiles(cli_in_process):
    """The recipe under the spatial strategy: each of 2 ranks reads and computes one half (W split) of the sample."""
    out = _fast_dev_run(cli_in_process, "mesh_tangling_1k", 2, "strategy=spatial", "strategy.spatial_parts=[1,2]")
    assert "MEMBER: 2/2" in out

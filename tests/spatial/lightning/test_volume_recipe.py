"""The 3-D recipe (``recipe=volumes_unet3d``): a fast_dev_run under the spatial strategy with sub-volumes on 2
processes, the data module reading only its sub-volume, and the recipe's stated activation figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lightning_hpc.data.volumes import SphereVolumeDataModule, sphere_volume
from lightning_hpc.models.unet import activation_bytes, unet
from lightning_hpc.spatial.layout.tiling import tile_slices

ROOT = Path(__file__).resolve().parents[3]


def test_volume_recipe_fast_dev_run_on_sub_volumes(cli_in_process):
    tmp_path = cli_in_process.cwd
    proc = cli_in_process(
        "train", "recipe=volumes_unet3d", "trainer.fast_dev_run=true",
        "input_shape=[1,13,12,10]", "model.widths=[4,8]", "data.train_samples=2", "data.val_samples=1",
        f"data.data_dir={tmp_path / 'volumes'}", "trainer.accelerator=cpu", "trainer.devices=2",
        "strategy.spatial_parts=[2,1,1]", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert "val/iou" in proc.stdout and "train/loss" in proc.stdout
    assert "MEMBER: 2/2" in proc.stdout


def test_sub_volume_dataset_reads_its_tile_of_the_written_volume(tmp_path):
    dm = SphereVolumeDataModule(data_dir=str(tmp_path), size=(9, 8, 7), train_samples=2, val_samples=1)
    dm.prepare_data()
    dm.set_spatial_tile((1, 0, 1), (2, 1, 2))
    dm.setup("fit")
    x, y = dm.train_set[1]
    whole_x, whole_y = sphere_volume((9, 8, 7), 0, 1)
    cut = (slice(None),) + tile_slices((9, 8, 7), (2, 1, 2), (1, 0, 1))
    assert x.shape == (1, 4, 8, 3) and torch.equal(x, torch.from_numpy(whole_x[cut]))
    assert torch.equal(y, torch.from_numpy(whole_y[cut]))
    # the files are memory-mapped: the dataset never holds a whole volume
    assert isinstance(np.load(tmp_path / "train" / "00001_x.npy", mmap_mode="r"), np.memmap)


def test_labels_need_more_context_than_one_sub_volume():
    """A labelled (large) sphere reaches across more voxels than a sub-volume of a 4-way split holds along D."""
    x, y = sphere_volume((64, 64, 64), 0, 0)
    depth = np.nonzero(y[0].any(axis=(1, 2)))[0]
    assert len(depth) > 64 // 4


def test_recipe_activation_figure():
    """The recipe says one 128^3 sample takes 1.72 GiB of activations with its U-Net (measured at 64^3: the
    activations grow with the voxels, once the coarsest level is a few voxels wide)."""
    model = unet(1, 1, (16, 32, 64, 128))
    small = activation_bytes(model, (1, 32, 32, 32))
    measured = activation_bytes(model, (1, 64, 64, 64))
    assert abs(measured / small - 8) < 0.01
    assert abs(measured * 8 / 2**30 - 1.72) < 0.005

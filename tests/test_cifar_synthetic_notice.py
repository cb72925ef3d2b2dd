"""`recipe=resnet_cifar` without data.root trains on synthetic images: the user must be told, not left to guess."""

import warnings

import pytest

from lightning_hpc.data import Cifar10DataModule


def test_cifar10_without_root_warns_that_data_is_synthetic():
    dm = Cifar10DataModule(None, synthetic_train_size=8, synthetic_val_size=4)
    with pytest.warns(UserWarning, match=r"data\.root is not set.*synthetic.*data\.root=/path/to/cifar-10-batches-py"):
        dm.setup()
    assert len(dm.train_set) == 8


def test_cifar10_with_root_does_not_warn(tmp_path):
    import pickle

    import numpy as np

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 1]}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Cifar10DataModule(str(tmp_path), num_workers=0).setup()

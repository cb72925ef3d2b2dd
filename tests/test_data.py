import pickle
import random

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_hpc.data import (
    Cifar10DataModule,
    DigitsDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
    SyntheticImages,
)
from lightning_hpc.data.transforms import (
    CenterCrop,
    RandomResizedCrop,
    Resize,
    ToNormalizedTensor,
    random_resized_crop_box,
)
from lightning_hpc.distributed.partition import block_bounds, block_range, block_sizes


def write_jpeg_tree(root, classes=("cat", "dog", "emu"), per_class=3, size=(300, 260)):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(arr).save(d / f"img{i}.JPEG", quality=90)
    return root


def test_digits_split_and_normalisation():
    dm = DigitsDataModule(batch_size=16, val_fraction=0.2)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == 1797
    assert len(dm.val_set) == round(1797 * 0.2)
    x, y = dm.train_set.tensors
    assert x.shape[1:] == (1, 8, 8) and set(y.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3


def test_synthetic_is_deterministic_per_index_and_seed():
    a, b = SyntheticImages(10, (3, 8, 8), 5, seed=3), SyntheticImages(10, (3, 8, 8), 5, seed=3)
    for i in (0, 7):
        assert torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]
    assert not torch.equal(a[0][0], SyntheticImages(10, (3, 8, 8), 5, seed=4)[0][0])
    dm = SyntheticDataModule((3, 16, 16), num_classes=4, train_size=20, val_size=8, batch_size=4)
    dm.setup()
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 3, 16, 16) and yb.max() < 4


def test_imagefolder_reads_jpeg_tree_with_imagenet_transforms(tmp_path):
    write_jpeg_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=4, num_workers=0, image_size=224, num_classes=3)
    dm.setup()
    assert dm.train_set.classes == ["cat", "dog", "emu"] and len(dm.train_set) == 9
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 224, 224)
    xv, yv = dm.val_set[0]
    assert xv.shape == (3, 224, 224) and yv == 0
    # normalisation with the ImageNet statistics: uniform noise maps to roughly zero mean
    assert abs(float(xv.mean())) < 0.6


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_imagefolder_missing_or_empty_directory_fails_at_setup(tmp_path, make):
    root = tmp_path / "imagenet"
    if make == "empty":
        root.mkdir()
    dm = ImageFolderDataModule(str(root))
    with pytest.raises(FileNotFoundError, match=r"(?s)imagenet.*data=synthetic"):
        dm.setup()


def test_imagefolder_class_count_mismatch(tmp_path):
    write_jpeg_tree(tmp_path)
    with pytest.raises(ValueError, match="num_classes=1000"):
        ImageFolderDataModule(str(tmp_path), num_workers=0, num_classes=1000).setup()


def test_random_resized_crop_box_in_bounds_and_fallback():
    rng = random.Random(0)
    for _ in range(200):
        left, top, w, h = random_resized_crop_box(300, 200, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= left and left + w <= 300 and 0 <= top and top + h <= 200
    # an extreme aspect ratio can never satisfy the constraint: center crop fallback
    left, top, w, h = random_resized_crop_box(1000, 10, (0.99, 1.0), (1.0, 1.0), rng)
    assert (w, h) == (10, 10) and left == 495


def test_resize_center_crop_and_tensor():
    img = Image.fromarray(np.full((300, 400, 3), 255, dtype=np.uint8))
    out = CenterCrop(224)(Resize(256)(img))
    assert out.size == (224, 224)
    assert Resize(256)(img).size == (341, 256)
    x = ToNormalizedTensor((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(out)
    assert torch.allclose(x, torch.ones(3, 224, 224))
    assert RandomResizedCrop(64)(img).size == (64, 64)


def test_cifar10_reader(tmp_path):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump(
                {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 4))}, f
            )
    dm = Cifar10DataModule(str(tmp_path), batch_size=2, num_workers=0)
    dm.setup()
    assert len(dm.train_set) == 20 and len(dm.val_set) == 4
    assert dm.train_set[0][0].shape == (3, 32, 32)
    (tmp_path / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        Cifar10DataModule(str(tmp_path)).setup()


def test_cifar10_synthetic_without_root():
    dm = Cifar10DataModule(None, synthetic_train_size=8, synthetic_val_size=4)
    dm.setup()
    assert len(dm.train_set) == 8 and dm.train_set[0][0].shape == (3, 32, 32)


def test_block_partition():
    assert block_sizes(10, 4) == [3, 3, 2, 2]
    assert block_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert block_range(7, 2, 1) == (4, 7)
    with pytest.raises(ValueError, match="at most 3 parts"):
        block_sizes(3, 4)

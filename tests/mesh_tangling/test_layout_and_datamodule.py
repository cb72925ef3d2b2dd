import re

import numpy as np
import pytest
import torch

from lightning_hpc.data.mesh_tangling import CHANNELS, TARGET, MeshTanglingDataModule, channel_path, read_tile
from lightning_hpc.data.mesh_tangling.cli import main as mesh_data_main
from lightning_hpc.data.mesh_tangling.dataset import normalize_channels
from lightning_hpc.distributed.partition import block_bounds

SIZE = 64  # matches the sample0 fixture (conftest.py)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    assert mesh_data_main(["--size", str(SIZE), "--samples", "2", "--out", str(out), "--quiet"]) == 0
    return out


def test_files_match_lbann_layout(data_dir, sample0):
    for name in (*CHANNELS, TARGET):
        for index in (0, 1):
            path = data_dir / name / f"{name}{index:04d}.bin"
            assert path == channel_path(data_dir, name, index)
            assert path.stat().st_size == 4 * SIZE * SIZE
        raw = np.fromfile(data_dir / name / f"{name}0000.bin", dtype=np.float32).reshape(SIZE, SIZE)
        np.testing.assert_array_equal(raw, sample0[name])  # raw row-major float32 of sample 0


def test_tile_read_equals_slice_of_full_sample(data_dir, sample0):
    for rows, cols in (((0, SIZE), (0, SIZE)), ((5, 27), (40, 64)), ((63, 64), (0, 1))):
        for name in ("Density", "jacobian", TARGET):
            tile = read_tile(data_dir, name, 0, (SIZE, SIZE), rows, cols)
            np.testing.assert_array_equal(tile, sample0[name][rows[0] : rows[1], cols[0] : cols[1]])
    with pytest.raises(ValueError, match="outside"):
        read_tile(data_dir, "Density", 0, (SIZE, SIZE), (0, SIZE + 1))


def _full_from_tiles(dm_factory, parts):
    ph, pw = parts
    rows_b, cols_b = block_bounds(SIZE, ph), block_bounds(SIZE, pw)
    x_full = torch.empty(len(CHANNELS), SIZE, SIZE)
    y_full = torch.empty(1, SIZE, SIZE)
    for i in range(ph):
        for j in range(pw):
            dm = dm_factory()
            dm.set_spatial_tile((i, j), parts)  # before the dataloaders, as the strategy does
            dm.setup("fit")
            x, y = next(iter(dm.train_dataloader()))
            (r0, r1), (c0, c1) = rows_b[i], cols_b[j]
            assert x.shape == (1, len(CHANNELS), r1 - r0, c1 - c0) and y.shape == (1, 1, r1 - r0, c1 - c0)
            x_full[:, r0:r1, c0:c1], y_full[:, r0:r1, c0:c1] = x[0], y[0]
    return x_full, y_full


@pytest.mark.parametrize("parts", [(2, 3), (1, 4)])
def test_datamodule_tile_contract_disk(data_dir, sample0, parts):
    def factory():
        return MeshTanglingDataModule(data_dir=str(data_dir), train_samples=1, val_samples=1, size=SIZE)

    x, y = _full_from_tiles(factory, parts)
    expected = normalize_channels(torch.from_numpy(np.stack([sample0[c] for c in CHANNELS])), 1.0 / SIZE**2)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    torch.testing.assert_close(y[0], torch.from_numpy(sample0[TARGET]), rtol=0, atol=0)


def test_datamodule_on_the_fly_matches_disk(data_dir):
    disk = MeshTanglingDataModule(data_dir=str(data_dir), train_samples=1, val_samples=1, normalize=False)
    fly = MeshTanglingDataModule(on_the_fly=True, size=SIZE, train_samples=1, val_samples=1, normalize=False)
    for dm in (disk, fly):
        dm.setup("fit")
        dm.set_spatial_tile((1, 0), (2, 2))  # after setup: applies to the existing datasets
    (xd, yd), (xf, yf) = disk.val_set[0], fly.val_set[0]
    assert xd.shape == (18, SIZE // 2, SIZE // 2) and disk.input_shape == (18, SIZE, SIZE)
    torch.testing.assert_close(xd, xf, rtol=0, atol=0)
    torch.testing.assert_close(yd, yf, rtol=0, atol=0)


def test_missing_data_dir_points_to_on_the_fly(tmp_path):
    dm = MeshTanglingDataModule(data_dir=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="on_the_fly"):
        dm.setup("fit")
    with pytest.raises(FileNotFoundError, match="mesh-data"):
        MeshTanglingDataModule(data_dir=None).setup("fit")
    with pytest.raises(ValueError, match="out of range"):
        MeshTanglingDataModule(on_the_fly=True).set_spatial_tile((2, 0), (2, 2))


def test_mesh_data_says_the_bytes_and_time_it_will_take_before_it_starts(tmp_path, capsys):
    """``lightning-hpc mesh-data`` prints the byte count it will write (and a time estimate) before the first
    sample: the announced count equals the bytes of the files written."""
    import re

    from lightning_hpc.data.mesh_tangling.cli import planned_bytes

    out = tmp_path / "mesh"
    assert mesh_data_main(["--size", "16", "--samples", "3", "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    announced = re.fullmatch(r"mesh-data: 3 samples of 19 x 16 x 16 float32 .* = ([\d,]+) bytes .*about \d+ s .*",
                             lines[0])
    assert announced, lines
    assert lines[1].startswith("wrote 3 samples"), lines  # the announcement came first
    written = sum(p.stat().st_size for p in out.rglob("*.bin"))
    assert int(announced.group(1).replace(",", "")) == written == planned_bytes(16, 3)
    # the README's 1024^2 x 16 data set: 1.27 GB
    assert planned_bytes(1024, 16) == 19 * 4 * 1024 * 1024 * 16


@pytest.mark.slow  # the workers are fresh interpreters: seconds to import torch
def test_mesh_data_workers_write_the_same_bytes_as_one_worker(tmp_path, capsys):
    """``--workers 2`` generates the samples in two processes at once: every file is byte for byte the one a single
    worker writes (a sample depends on the seed and its index only), ``meta.json`` included, and the summary line
    counts the same share of tangling cells."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--size", "24", "--samples", "3", "--start", "1", "--steps", "4", "--lookahead", "2", "--quiet"]
    assert mesh_data_main([*common, "--out", str(one)]) == 0
    summary_one = capsys.readouterr().out.splitlines()[-1]
    assert mesh_data_main([*common, "--out", str(two), "--workers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 workers at once" in lines[0], lines
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert len(files) == 19 * 3 + 1 and sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file()) == files
    for rel in files:
        assert (one / rel).read_bytes() == (two / rel).read_bytes(), rel
    # the share of tangling cells (the summary's last figure) is the same sum, whatever order the samples finished in
    share = re.compile(r"([\d.]+)% cells labelled tangling")
    assert abs(float(share.search(summary_one).group(1)) - float(share.search(lines[-1]).group(1))) < 2e-3


@pytest.mark.parametrize("bad", [["--workers", "0"], ["--threads", "0"]])
def test_mesh_data_refuses_no_workers_or_threads_before_writing(tmp_path, capsys, bad):
    out = tmp_path / "mesh"
    assert mesh_data_main(["--size", "16", "--samples", "1", "--out", str(out), *bad]) == 2
    assert "--workers and --threads >= 1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("threads", "cores", "workers"), [(1, 4, 4), (2, 4, 2), (3, 2, 1)])
def test_mesh_data_auto_workers_are_the_cores_over_the_threads(tmp_path, capsys, monkeypatch, threads, cores,
                                                               workers):
    """``--workers auto``: one worker per ``--threads`` of the cores the process may run on (its affinity), at least
    one; the announcement says how many (the generation itself is stubbed: only the count is under test)."""
    import os

    from lightning_hpc.data.mesh_tangling import cli

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    seen = []
    monkeypatch.setattr(cli, "_written", lambda args, indices, n: seen.append(n) or iter([0.0] * len(indices)))
    argv = ["--size", "16", "--samples", "8", "--out", str(tmp_path / "m"), "--threads", str(threads), "--quiet",
            "--workers", "auto"]
    assert mesh_data_main(argv) == 0
    assert seen == [workers]
    first = capsys.readouterr().out.splitlines()[0]
    assert (f"({workers} workers at once" in first) == (workers > 1), first
    with pytest.raises(SystemExit):
        mesh_data_main(["--out", str(tmp_path / "x"), "--workers", "many"])

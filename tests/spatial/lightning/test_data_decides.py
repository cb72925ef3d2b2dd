"""The data decides which batch tensors are split, never their shape.

The strategy splits the model's input (the first N x C x H x W tensor) or what the data module declares in
``spatial_tiles``; every other tensor stays whole and is cut exactly where it meets a split activation.  A label
at the output's lower resolution whose size happens to equal a tile is therefore whole: ``Trainer.fit`` with a
plain mean loss, and with the documented ``sum / strategy.global_pixel_count(target)`` form, equals one process
(even tiles, and uneven ones where the label matches one rank's tile only).  A data module that reads tiles but
declares nothing, next to a tensor as large as its tile, is refused on every rank before the first step.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.layout.tiling import tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.spatial_checks import serial_sgd_fit

TOL = 1e-5
N, C, CLASSES, W = 4, 3, 3, 10
BATCH, STEPS = 2, 3


class HalfRows(nn.Module):
    """A convolution with stride 2 along H only: the output (and its label) has half the rows, so at 2x1 the
    whole label (H/2 x W) is exactly as large as an input tile."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(C, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, CLASSES, 3, stride=(2, 1), padding=1))

    def forward(self, x):
        return self.body(x)


def make_data(h: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, C, h, W, generator=g)
    y = torch.randint(0, CLASSES, (N, (h + 1) // 2, W), generator=g)  # at the output's resolution, whole
    return x, y


def mean_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def upsampled_loss(model, x, y):
    """Output and label both brought to the input's resolution (nearest): a label taken for a tile would be used
    as the tile's label without any error."""
    out = F.interpolate(model(x), size=tuple(x.shape[-2:]))
    return F.cross_entropy(out, F.interpolate(y[:, None].float(), size=tuple(x.shape[-2:]))[:, 0].long())


class UserModule(pl.LightningModule):
    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.form = HalfRows(), form
        self.first_grads = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        if self.form == "mean":
            loss = F.cross_entropy(out, y)
        elif self.form == "upsampled":
            loss = upsampled_loss(self.model, x, y)
        else:  # the documented older form: sum over the pixels / pixels of the whole samples
            loss = F.cross_entropy(out, y, reduction="sum") / self.trainer.strategy.global_pixel_count(y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.first_grads is None:
            self.first_grads = [p.grad.detach().clone() for p in self.model.parameters()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WholeData(pl.LightningDataModule):
    """No tile hook: the strategy cuts the input on the host."""

    def __init__(self, x, y) -> None:
        super().__init__()
        self.x, self.y = x, y

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=False)


class TileReader(WholeData):
    """Reads the input's tile only; the label stays whole.  ``declare``: says so in ``spatial_tiles``."""

    def __init__(self, x, y, declare: bool) -> None:
        super().__init__(x, y)
        self.tile = None
        if declare:
            self.spatial_tiles = (0,)

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        x = self.x
        if self.tile is not None:
            rs, cs = tile_slices((x.shape[-2], x.shape[-1]), self.tile[1], self.tile[0])
            x = x[..., rs, cs].contiguous()
        return DataLoader(TensorDataset(x, self.y), batch_size=BATCH, shuffle=False)


def _split_run(rank, world, parts, cases):
    results = {}
    for h, data, form in cases:
        x, y = make_data(h)
        dm = WholeData(x, y) if data == "host" else TileReader(x, y, declare=data == "declared")
        module = UserModule(form)
        run = fit(module, datamodule=dm, devices=world, strategy=SpatialParallelStrategy(spatial_parts=parts),
                  max_steps=STEPS, max_epochs=1, use_distributed_sampler=False, refusal_is_result=True,
                  params=lambda m: m.model.parameters())
        if run.error is not None:  # the refusal is the result
            results[(h, data, form)] = {"error": run.error, "steps": run.steps}
            continue
        results[(h, data, form)] = {"loss": run.metric(), "grads": module.first_grads, "params": run.params}
    return results


def _err(a, b) -> float:
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


CASES = [(h, data, form) for h in (16, 13) for data in ("host", "declared") for form in ("mean", "count", "upsampled")]


def test_whole_label_at_tile_size_equals_one_process():
    """H = 16 at 2x1: the whole 8 x 10 label is exactly an input tile.  It was split: a loss on it raised torch's
    size error, and brought to the input's resolution it trained silently differently.  H = 13: the 7 x 10 label
    is rank 0's tile but not rank 1's."""
    refs = {}
    for h in (16, 13):
        for form, loss in (("mean", mean_loss), ("upsampled", upsampled_loss)):
            torch.manual_seed(0)
            refs[h, form] = serial_sgd_fit(HalfRows(), *make_data(h), loss, BATCH)
        refs[h, "count"] = refs[h, "mean"]
    _check(run_in_processes(_split_run, 2, (2, 1), CASES, timeout_s=600, collective_timeout_s=120), CASES, refs)


def test_global_pixel_count_of_a_whole_target_equals_one_process():
    """At 1x2 the 8 x 10 label is no tile's size (tiles are 16 x 5) and was never split, but
    ``global_pixel_count`` summed its count over the two tiles: the loss and every gradient were halved."""
    cases = [(16, "host", "count"), (16, "declared", "count")]
    torch.manual_seed(0)
    ref = serial_sgd_fit(HalfRows(), *make_data(16), mean_loss, BATCH)
    _check(run_in_processes(_split_run, 2, (1, 2), cases, timeout_s=300, collective_timeout_s=60), cases,
           {(16, "count"): ref})


def _check(results, cases, refs) -> None:
    for rank, res in enumerate(results):
        for case in cases:
            got, ref = res[case], refs[case[0], case[2]]
            assert "error" not in got, (rank, case, got.get("error"))
            assert abs(got["loss"] - ref["loss"]) <= TOL * max(1.0, abs(ref["loss"])), (case, got["loss"], ref["loss"])
            for k, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
                assert _err(g, r) <= TOL, f"{case}: gradient of parameter {k} differs by {_err(g, r)}"
            for k, (p, r) in enumerate(zip(got["params"], ref["params"])):
                assert _err(p, r) <= TOL, f"{case}: parameter {k} differs by {_err(p, r)}"


def test_undeclared_tile_reader_is_refused_on_every_rank():
    """A tile-reading data module without ``spatial_tiles`` beside a tensor as large as the input's tile: a tile
    or a whole lower-resolution label cannot be told apart.  Refused on both ranks, also when only rank 0's tile
    matches (H = 13), before the first optimizer step, naming the declaration that fixes it."""
    cases = [(16, "undeclared", "mean"), (13, "undeclared", "mean")]
    results = run_in_processes(_split_run, 2, (2, 1), cases, timeout_s=300, collective_timeout_s=60)
    for res in results:
        for case in cases:
            err = res[case].get("error")
            assert err is not None and "spatial_tiles = (0,)" in err, (case, err)
            assert res[case]["steps"] == 0


@pytest.mark.parametrize("marked", [False, True])
def test_global_pixel_count_counts_whole_tensors_once(marked):
    """Single process, no group: a whole tensor (per-row labels, a label after pooling) counts its own elements;
    a tile cut out with ``local_tile`` would be summed over the group (nothing to sum here)."""
    from lightning_hpc.spatial.dispatch.tensor import TILE_MARK

    strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    rows = torch.zeros(2, 7, dtype=torch.long)
    if marked:
        setattr(rows, TILE_MARK, True)
    assert strategy.global_pixel_count(rows) == 14


def _hand_cut_tile_count(rank, world):
    from lightning_hpc.spatial.dispatch import local_tile, split_tensor
    from lightning_hpc.spatial.layout.tiling import create_hybrid_layout

    strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    strategy.layout = create_hybrid_layout((2, 1))
    grid = strategy.layout.grid
    y = torch.zeros(2, 7, 5, dtype=torch.long)
    rs, cs = tile_slices((7, 5), (2, 1), grid.index)
    tile = local_tile(split_tensor(y[:, rs, cs].contiguous(), grid, y.shape))
    return strategy.global_pixel_count(tile), tile.numel()


def test_global_pixel_count_sums_a_hand_cut_tile_over_the_spatial_group():
    """Two processes at 2x1 with uneven tiles (rows 4 and 3 of 7): a tile cut out with ``local_tile`` counts the
    whole sample's pixels on every rank, its own count summed over the spatial group."""
    results = run_in_processes(_hand_cut_tile_count, 2, timeout_s=120)
    assert sorted(local for _, local in results) == [30, 40], results
    assert [count for count, _ in results] == [70, 70], results


def test_declared_entries_of_dict_and_nested_batches():
    """Single process: ``spatial_tiles`` names keys of a dict batch and paths into nested batches; undeclared, the
    first N x C x H x W tensor is the input; a name that is not a tensor of the batch is refused naming it."""
    from types import SimpleNamespace

    from lightning_hpc.spatial.lightning.strategy import _get, _set

    strategy = SpatialParallelStrategy(spatial_parts=(2, 1))
    image, mask, label = torch.zeros(2, 3, 8, 6), torch.zeros(2, 8, 6), torch.zeros(2, 4, 6)
    batch = {"meta": {"label": label}, "image": image, "mask": mask}
    strategy._datamodule = lambda: SimpleNamespace(spatial_tiles=("image", "mask"))
    assert strategy._split_paths(batch) == [("image",), ("mask",)]
    strategy._datamodule = lambda: SimpleNamespace(spatial_tiles=(("meta", "label"),))
    assert strategy._split_paths(batch) == [("meta", "label")]
    strategy._datamodule = lambda: None
    assert strategy._split_paths((label, image, mask)) == [(1,)]
    strategy._datamodule = lambda: SimpleNamespace(spatial_tiles=("images",))
    with pytest.raises(ValueError, match="spatial_tiles names batch entry"):
        strategy._split_paths(batch)
    replaced = _set(batch, ("meta", "label"), mask)
    assert _get(replaced, ("meta", "label")) is mask and batch["meta"]["label"] is label  # the batch itself kept


"""SpatialParallelStrategy in a real Lightning Trainer, and the setup-time errors."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch.split_check import check_split
from lightning_hpc.spatial.layout.halo_exchange import PartitionError
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.dispatch.test_spatial_models import data, small_fcn
from tests.spatial.spatial_checks import TOL, TileDataModule

BATCH, STEPS = 2, 2


class Segmenter(pl.LightningModule):
    """Per-pixel loss normalised by the pixels of the whole samples (the SegmentationModule contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = small_fcn()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        count_fn = getattr(self.trainer.strategy, "global_pixel_count", None)
        total = count_fn(y) if count_fn is not None else y.numel()
        loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / total
        self.log("train/loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def serial_reference():
    model = small_fcn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    loss = None
    for step in range(STEPS):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(xb), yb, reduction="sum") / yb.numel()
        loss.backward()
        opt.step()
    return float(loss.detach()), [p.detach().clone() for p in model.parameters()]


def _split_run(rank: int, world: int, parts):
    errors = {}
    try:  # world size not divisible by ph * pw: clear error before anything runs
        create_hybrid_layout((world + 1, 1))
    except ValueError as e:
        errors["divisible"] = str(e)
    torch.manual_seed(0)
    module, dm = Segmenter(), TileDataModule(*data(), batch_size=BATCH)
    strategy = SpatialParallelStrategy(spatial_parts=parts)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    run = fit(module, datamodule=dm, devices=world, strategy=strategy, max_steps=STEPS,
              params=lambda m: m.model.parameters())
    return {
        "said": said,
        "tile": dm.tile,
        "loss": run.metric("train/loss"),
        "params": [p.numpy().copy() for p in run.params],
        "sampler": strategy.distributed_sampler_kwargs,
        "errors": errors,
    }


def test_lightning_fit_matches_serial():
    results = run_in_processes(_split_run, 2, (2, 1), timeout_s=300, collective_timeout_s=120)
    ref_loss, ref_params = serial_reference()
    for rank, res in enumerate(results):
        assert res["tile"] == ((rank, 0), (2, 1))
        assert res["sampler"] == {"num_replicas": 1, "rank": 0}  # both ranks read the same samples
        assert abs(res["loss"] - ref_loss) <= TOL, (res["loss"], ref_loss)
        for p, q in zip(res["params"], ref_params):
            assert float((torch.from_numpy(p) - q).abs().max()) <= TOL
        assert "not divisible by spatial_parts=3x1" in res["errors"]["divisible"]
    # the split that runs is logged once (rank 0)
    assert "SpatialParallelStrategy: 2x1 (H x W) tiles per sample, 1 sample group(s) of 2 rank(s)" in \
        results[0]["said"], results[0]["said"]


def test_strategy_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_hpc  # noqa: F401

    assert "spatial" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("spatial"), SpatialParallelStrategy)


def test_partition_error_names_layer_size_and_largest_partition():
    from lightning_hpc.models import resnet50

    model = resnet50(num_classes=10)
    check_split(model, (3, 64, 48), (2, 2))  # fine
    with pytest.raises(
        PartitionError,
        match=r"layer 'layer4\.0\.downsample\.0'.*input 4x3 \(H x W\).*split 4x1: along H its output of 2 rows has "
              r"fewer rows than the 4 parts.*largest split of H that works for this layer is 2 \(e\.g\. spatial_parts="
              r"\[2, 1\]\)"
    ):
        check_split(model, (3, 64, 48), (4, 1))


def test_tile_smaller_than_halo_is_rejected():
    model = nn.Sequential(nn.Conv2d(1, 1, 7, padding=3))  # 6 rows over 3 tiles: 2 rows each, halo of 3
    with pytest.raises(
        PartitionError,
        match=r"layer '0'.*input 6x40.*a tile of 2 rows is thinner than the halo.*largest split of H that works for "
              r"this layer is 2",
    ):
        check_split(model, (1, 6, 40), (3, 1))


def test_sub_volume_thinner_than_the_halo_and_splits_of_other_dimensions_are_refused():
    volume = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 5, padding=4, dilation=2))
    check_split(volume, (1, 8, 16, 16), (2, 2, 1))
    with pytest.raises(PartitionError, match=r"layer '1' \(Conv3d\).*\(D x H x W\).*along D.*largest split of D "
                                             r"that works for this layer is 2 \(e\.g\. spatial_parts=\[2, 1, 1\]\)"):
        check_split(volume, (1, 8, 16, 16), (4, 1, 1))  # 2-row sub-volumes, a halo of 4 rows
    with pytest.raises(ValueError, match=r"splits 2 spatial dimension\(s\).*\('D', 'H', 'W'\)"):
        check_split(volume, (1, 8, 16, 16), (2, 1))
    signal = nn.Sequential(nn.Conv1d(1, 1, 3, padding=1), nn.MaxPool1d(4))
    check_split(signal, (1, 32), (4,))
    with pytest.raises(PartitionError, match=r"layer '1' \(MaxPool1d\).*along L its output of 5 rows.*largest "
                                             r"split of L that works for this layer is 5"):
        check_split(signal, (1, 20), (8,))


def test_bad_settings_fail_clearly():
    with pytest.raises(ValueError, match="spatial_parts"):
        SpatialParallelStrategy(spatial_parts=(0, 2))
    with pytest.raises(ValueError, match="spatial_parts"):
        SpatialParallelStrategy(spatial_parts="fast")
    try:
        import lightning_hpc.spatial.planner  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="planner"):
            SpatialParallelStrategy(spatial_parts="auto")._resolve_parts()


@pytest.mark.slow
def test_cli_fast_dev_run_with_spatial_strategy(tmp_path):
    """`lightning-hpc train ... strategy=spatial` on 2 processes (digits: 8x8 images split 2x1, a global-pool
    head replicated over the tiles)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lightning_hpc", "train", "recipe=digits", "strategy=spatial",
           "strategy.spatial_parts=[2,1]", "trainer.devices=2", "trainer.fast_dev_run=true",
           f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_refusal_offers_a_split_of_the_same_ranks_first():
    """A volume too thin along D for 4 parts: the first fix named splits the same 4 ranks along other dimensions
    (one every layer takes), before shrinking the failing dimension's split (which would leave ranks idle)."""
    volume = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 5, padding=4, dilation=2))
    with pytest.raises(PartitionError, match=r"along D.*Fix: split the same 4 ranks per sample as "
                                             r"spatial_parts=\[1, 1, 4\], which every layer takes; or the largest "
                                             r"split of D"):
        check_split(volume, (1, 8, 16, 16), (4, 1, 1))
    check_split(volume, (1, 8, 16, 16), (1, 1, 4))  # the offered fix works
    tiny = nn.Sequential(nn.Conv2d(1, 1, 7, padding=3))  # no split of 6 ranks works on 6x6: only the shrink is named
    with pytest.raises(PartitionError, match=r"Fix: the largest split of H"):
        check_split(tiny, (1, 6, 6), (6, 1))

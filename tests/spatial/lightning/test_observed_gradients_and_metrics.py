"""What user code observes under ``strategy="spatial"`` equals one process: gradients taken with respect to a split
activation (``torch.autograd.grad``, a ``register_hook`` that normalises the gradient), gradients read between
``manual_backward`` and ``step`` (``self.clip_gradients``), and torchmetrics objects fed split activations or
replicated values (unnormalised counts and sums, which an all-rank sum would count once per tile).

Reference: the same LightningModule fitted by ``Trainer(devices=1)`` in this process.  Spatial: 2 ranks, 2x1 and
1x2 tiles of an uneven 13 x 10 image (one sample group: both ranks read the same batches).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassConfusionMatrix

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.layout.tiling import tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import Fit, fit, trainer

N, C, H, W, CLASSES, BATCH = 4, 3, 13, 10, 3, 2
TOL = 1e-5


def make_data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, C, H, W, generator=g), torch.randint(0, CLASSES, (N, H, W), generator=g)


class Net(nn.Module):
    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        norm = nn.BatchNorm2d(6) if batch_norm else nn.Identity()
        self.body = nn.Sequential(nn.Conv2d(C, 6, 3, padding=1), norm, nn.ReLU())
        self.head = nn.Conv2d(6, CLASSES, 3, padding=1)


class Observing(pl.LightningModule):
    """Reads gradients of a split activation, normalises them in a hook, and counts with torchmetrics."""

    def __init__(
        self, manual: bool = False, penalty: str | None = None, batch_norm: bool = True, hook: bool = True
    ) -> None:
        super().__init__()
        self.hook = hook
        torch.manual_seed(0)
        self.model = Net(batch_norm)
        self.automatic_optimization = not manual
        self.penalty = penalty
        self.confusion = MulticlassConfusionMatrix(CLASSES)  # fed split logits: unnormalised pixel counts
        self.positive = torchmetrics.SumMetric()  # fed a split probability map: a sum over pixels
        self.loss_sum = torchmetrics.SumMetric()  # fed the replicated loss: one value per step
        self.observed: dict[str, list[float]] = {"dl_dh_norm": [], "hook_norm": [], "clipped_norm": []}

    def _normalise(self, g: torch.Tensor) -> torch.Tensor:
        norm = g.norm()
        self.observed["hook_norm"].append(float(norm))
        return g / (norm + 1.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.penalty == "input":
            x = x.clone().requires_grad_(True)
        h = self.model.body(x)
        if self.hook:
            h.register_hook(self._normalise)
        out = self.model.head(h)
        loss = F.cross_entropy(out, y)
        (dl_dh,) = torch.autograd.grad(loss, h, retain_graph=True)
        self.observed["dl_dh_norm"].append(float(dl_dh.norm()))
        if self.penalty == "input":  # WGAN-GP style: differentiates through the tiles twice
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = loss + gx.pow(2).mean()
        elif self.penalty == "params":
            grads = torch.autograd.grad(loss, list(self.model.parameters()), create_graph=True, retain_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads)
        self.confusion(out.detach(), y)
        self.positive(out.detach().softmax(1)[:, 0])
        self.loss_sum(loss.detach())
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.observed["clipped_norm"].append(float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))))
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def on_train_epoch_end(self) -> None:
        self.final = {"confusion": self.confusion.compute().clone(), "positive": self.positive.compute().clone(),
                      "loss_sum": self.loss_sum.compute().clone()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def predict_step(self, batch, batch_idx):
        return self.model.head(self.model.body(batch[0])).softmax(1)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH, order: list[int] | None = None) -> None:
        super().__init__()
        self.tile, self.batch_size, self.order = None, batch_size, order
        self.spatial_tiles = (0, 1)  # both read as tiles

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        x, y = make_data()
        if self.order is not None:
            x, y = x[self.order], y[self.order]
        if self.tile is not None:
            rs, cs = tile_slices((H, W), self.tile[1], self.tile[0])
            x, y = x[..., rs, cs].contiguous(), y[..., rs, cs].contiguous()
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)

    predict_dataloader = train_dataloader


def _result(run: Fit) -> dict:
    """What the assertions read of a run (its module stays on the rank that trained it)."""
    return {"params": run.params, "observed": run.module.observed, "final": run.module.final, "loss": run.metric(),
            "steps": run.steps}


def _split_run(rank, world, parts, manual, penalty=None):
    module = Observing(manual=manual, penalty=penalty)
    run = fit(module, datamodule=Data(), devices=world, strategy=SpatialParallelStrategy(spatial_parts=parts),
              use_distributed_sampler=False, max_epochs=1, refusal_is_result=True)
    if run.error is not None:  # the refusal is the result
        return {"error": run.error, "steps": run.steps}
    return _result(run)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual_clip"])
@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_observed_gradients_and_metrics_equal_one_process(parts, manual):
    ref = _result(fit(Observing(manual=manual), datamodule=Data(), max_epochs=1))
    for rank, res in enumerate(run_in_processes(_split_run, 2, parts, manual, timeout_s=300, collective_timeout_s=60)):
        what = f"rank {rank} at {parts[0]}x{parts[1]}"
        assert "error" not in res, res.get("error")
        for key, values in ref["observed"].items():
            got = res["observed"][key]
            assert len(got) == len(values) and all(map(_close, got, values)), f"{what}: {key} {got} != {values}"
        # unnormalised counts and sums: one process's values, not once per tile
        assert torch.equal(res["final"]["confusion"], ref["final"]["confusion"]), what
        assert int(ref["final"]["confusion"].sum()) == N * H * W
        for key in ("positive", "loss_sum"):
            assert _close(float(res["final"][key]), float(ref["final"][key])), (
                what,
                key,
                res["final"][key],
                ref["final"][key],
            )
        assert _close(res["loss"], ref["loss"]), what
        for k, (p, r) in enumerate(zip(res["params"], ref["params"])):
            assert (p - r).abs().max() <= TOL, f"{what}: parameter {k} differs by {(p - r).abs().max():.3g}"


def test_second_derivatives_through_tiles_are_refused_before_the_first_step():
    results = run_in_processes(_split_run, 2, (2, 1), False, "input", timeout_s=300, collective_timeout_s=60)
    for res in results:
        assert "torch.autograd.grad(create_graph=True)" in res.get("error", ""), res
        assert "gather_tensor" in res["error"] and res["steps"] == 0
    # with respect to parameters met on tiles: their gradient would be the tile's part
    results = run_in_processes(_split_run, 2, (2, 1), False, "params", timeout_s=300, collective_timeout_s=60)
    for res in results:
        assert "torch.autograd.grad with respect to parameter 'model.body.0.weight'" in res.get("error", ""), res
        assert "manual_backward" in res["error"] and res["steps"] == 0


def test_tile_local_batch_norm_is_refused_by_the_strategy():
    with pytest.raises(ValueError, match="batchnorm='local'.*whole sample"):
        SpatialParallelStrategy(spatial_parts=(2, 1), batchnorm="local")


def _precision_run(rank, world, parts, precision):
    module = Observing()
    return _result(fit(module, datamodule=Data(), devices=world, strategy=SpatialParallelStrategy(spatial_parts=parts),
                       use_distributed_sampler=False, max_epochs=1, precision=precision))


def test_bf16_mixed_equals_one_process_within_its_rounding():
    """bf16-mixed: the tiled convolutions cast as autocast does and batch norm keeps float32 statistics; the
    parameters after the steps differ from one bf16-mixed process by far less than bf16-mixed differs from
    float32 (the method's own rounding), not by a dtype crash or a silent drift."""
    bf16, fp32 = (_result(fit(Observing(), datamodule=Data(), max_epochs=1, precision=precision))
                  for precision in ("bf16-mixed", "32-true"))
    rounding = max(float((p - q).abs().max()) for p, q in zip(bf16["params"], fp32["params"]))
    assert rounding > 1e-4, "bf16-mixed did not change the result: autocast was not active"
    for res in run_in_processes(_precision_run, 2, (2, 1), "bf16-mixed", timeout_s=300, collective_timeout_s=60):
        worst = max(float((p - q).abs().max()) for p, q in zip(res["params"], bf16["params"]))
        assert worst < 0.25 * rounding, (
            f"spatial bf16-mixed differs from one process by {worst:.3g} (bf16 vs fp32: {rounding:.3g})"
        )
        assert torch.equal(res["final"]["confusion"].sum(), bf16["final"]["confusion"].sum())


def _sample_groups_run(rank, world):
    module = Observing(batch_norm=False, hook=False)
    # Lightning's sampler over the 2 sample groups (shuffle=False, as the loader): group g reads samples g, g+2
    return _result(fit(module, datamodule=Data(), devices=world, strategy=SpatialParallelStrategy(spatial_parts=(2, 1)),
                       max_epochs=1))


def test_two_sample_groups_of_two_tiles_equal_one_process_on_the_global_batch():
    """4 ranks = 2 sample groups x 2x1 tiles: gradients averaged over sample groups, metrics fed replicated
    values synchronised over the replica groups (one count per sample).  Reference: one process whose batch b
    is the union of the two groups' batches b (no batch norm: its statistics are per sample group, as DDP's)."""
    order = [0, 2, 1, 3]  # batch 0 of group 0 = samples (0, 2), of group 1 = (1, 3)
    module = Observing(batch_norm=False, hook=False)  # a normalising hook would depend on the batch's size
    ref = _result(fit(module, datamodule=Data(batch_size=2 * BATCH, order=order), max_epochs=1))
    for rank, res in enumerate(run_in_processes(_sample_groups_run, 4, timeout_s=900, collective_timeout_s=300)):
        assert torch.equal(res["final"]["confusion"], ref["final"]["confusion"]), rank
        # a replicated value counts once per sample group (not once per tile): the two groups' mean losses add
        # up to twice the mean over their union
        assert _close(float(res["final"]["loss_sum"]), 2 * float(ref["final"]["loss_sum"])), (rank, res["final"])
        for p, r in zip(res["params"], ref["params"]):
            assert (p - r).abs().max() <= 2 * TOL, f"rank {rank}: parameters differ by {(p - r).abs().max():.3g}"
        assert _close(float(res["final"]["positive"]), float(ref["final"]["positive"])), rank


def _predict(rank, world):
    module = Observing()
    run = trainer(devices=world, strategy=SpatialParallelStrategy(spatial_parts=(1, 2)), max_epochs=1)
    out = run.predict(module, datamodule=Data())
    return [(type(t).__name__, t.clone()) for t in out]


def test_predictions_leave_the_strategy_whole():
    """trainer.predict returns plain, whole predictions on every rank (a split tensor used by rank 0 alone after
    predict would wait for its peers in a gather)."""
    module = Observing()
    ref = trainer(max_epochs=1).predict(module, datamodule=Data())
    for res in run_in_processes(_predict, 2, timeout_s=300, collective_timeout_s=60):
        assert [name for name, _ in res] == ["Tensor"] * len(ref)
        for (_, got), want in zip(res, ref):
            assert got.shape == want.shape and (got - want).abs().max() <= TOL

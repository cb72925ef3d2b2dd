"""``Trainer.fit`` of a ``torch.compile``'d model under ``strategy="spatial"`` with ``callbacks=[KFAC(...)]``
equals one process with the same callback, and the split step ran compiled on the steps K-FAC does not capture.

K-FAC captures its statistics on factor-update steps only (every ``factor_update_freq``-th step). Those forwards
run eagerly through the op dispatch (:class:`~lightning_hpc.kfac.compiled.CompiledUnderKFAC`), so K-FAC's hooks see
every layer and the tile kernels record the halo-padded input boxes of the tiled convolutions; every other forward
is the strategy's compiled split step, with K-FAC's hooks idle. So the
counts below are exact: ``eager_calls`` is the number of factor-update steps, the tile program is traced once and
every other step replays it. A negative control: with the eager route for the capture steps switched off (every
forward compiled, hooks idle), K-FAC captures nothing and the run differs from one process.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.compiled import CompiledUnderKFAC
from lightning_hpc.kfac.layers import TiledConvHandler
from lightning_hpc.spatial.dispatch import state
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.lightning.test_volumes import CLASSES, SubVolumes

TOL = 1e-9
STEPS_PER_EPOCH = 2  # SubVolumes' batches per epoch
EPOCHS = 3
#: factors every second step: steps 0, 2, 4 capture (eagerly), steps 1, 3, 5 run the compiled graph
KFAC_OPTIONS = dict(factor_update_freq=2, inv_update_freq=2, damping=0.01, kl_clip=0.01,
                    decomposition_dtype="float64")


def _net(kind: str) -> nn.Module:
    torch.manual_seed(3)
    if kind == "volume":  # 3x3x3, dilated, a 1x1x1 head: every tiled layer K-FAC preconditions
        return nn.Sequential(
            nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(),
            nn.Conv3d(4, 4, 3, padding=2, dilation=2), nn.Tanh(),
            nn.Conv3d(4, CLASSES, 1),
        )
    return nn.Sequential(  # a signal: 1-D convolutions on halves
        nn.Conv1d(2, 5, 5, padding=2), nn.ReLU(), nn.Conv1d(5, 5, 3, padding=1, bias=False), nn.Tanh(),
        nn.Conv1d(5, CLASSES, 3, padding=1),
    )


class Segmenter(pl.LightningModule):
    def __init__(self, kind: str, compiled: bool) -> None:
        super().__init__()
        self.model = _net(kind)
        if compiled:
            self.model = torch.compile(self.model, backend="eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class CompiledState(pl.Callback):
    """What the compiled module's split forward did, read before the strategy hands the module back."""

    def __init__(self) -> None:
        self.state: dict = {}

    def on_train_end(self, trainer, module) -> None:
        kfac = module.model.forward  # K-FAC's route (lightning_hpc.kfac.compiled), over the strategy's split step
        f = getattr(kfac, "inner", kfac)
        self.state = {k: getattr(f, k, None) for k in ("traces", "graphs", "refused")}
        self.state.update(kind=type(f).__name__, route=type(kfac).__name__, eager_calls=getattr(kfac, "eager_calls", 0))


def _run(rank: int, world: int, kind: str, parts, compiled: bool, never_eager: bool = False) -> dict:
    if never_eager:  # the negative control: the capture steps compiled too, so K-FAC's hooks stay idle on them
        CompiledUnderKFAC.captures = lambda self: False  # type: ignore[method-assign]
    module = Segmenter(kind, compiled)
    kfac, probe = KFAC(**KFAC_OPTIONS), CompiledState()
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    gathers = state().gathers
    run = fit(module, datamodule=SubVolumes(kind), devices=world, strategy=strategy, callbacks=[kfac, probe],
              max_epochs=EPOCHS, precision="64-true", use_distributed_sampler=False, refusal_is_result=never_eager)
    pre = kfac.preconditioner
    assert pre is not None
    return {"params": run.params, "gathers": state().gathers - gathers, "compiled": probe.state,
            "tiled": sorted(h.name for h in pre.handlers if isinstance(h, TiledConvHandler)),
            "steps": pre.steps, "error": run.error}


def _max_error(res: dict, ref: dict) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(res["params"], ref["params"]))


@pytest.mark.parametrize(("kind", "parts"), [
    pytest.param("volume", (2, 1, 1), id="volume-2x1x1"),
    pytest.param("volume", (1, 1, 2), id="volume-1x1x2", marks=pytest.mark.slow),
    pytest.param("signal", (2,), id="signal-2", marks=pytest.mark.slow),
])
def test_compiled_split_step_under_kfac_equals_one_process(kind, parts):
    ref = _run(0, 1, kind, None, compiled=False)
    steps = STEPS_PER_EPOCH * EPOCHS
    assert ref["steps"] == steps
    results = run_in_processes(_run, 2, kind, parts, True, timeout_s=600, collective_timeout_s=120)
    for rank, res in enumerate(results):
        what = f"{kind} at {parts}, rank {rank}"
        assert res["tiled"] == ["model._orig_mod.0", "model._orig_mod.2", "model._orig_mod.4"], (what, res["tiled"])
        assert res["gathers"] == 0, what
        err = _max_error(res, ref)
        assert err <= TOL, f"{what}: parameters differ from one process by {err:.3g}"
        # the factor-update steps (0, 2, 4) ran eagerly; the others replayed one tile program, traced once
        assert res["compiled"] == {"kind": "SplitCompiledForward", "route": "CompiledUnderKFAC", "traces": 1,
                                   "graphs": 1, "eager_calls": steps // 2, "refused": None}, (what, res["compiled"])


def test_compiling_the_capture_steps_too_loses_the_statistics():
    """Negative control: K-FAC's hooks idle on every forward (the capture steps compiled as well) leave K-FAC
    without a single statistic, which it refuses at its first factor step."""
    results = run_in_processes(_run, 2, "volume", (2, 1, 1), True, True, timeout_s=600, collective_timeout_s=120)
    for res in results:
        assert res["error"] is not None and "none of the hooks" in res["error"], res["error"]
        assert res["compiled"].get("eager_calls", 0) == 0, res["compiled"]


def _image_run(rank: int, world: int, parts, compiled: bool) -> dict:
    from tests.spatial.lightning import test_split_equals_one_process as idioms

    x, seg, _ = idioms.make_data()
    module = idioms.UserModule(idioms.build("se_block"))
    if compiled:
        module.model = torch.compile(module.model, backend="eager")
    kfac, probe = KFAC(**KFAC_OPTIONS), CompiledState()
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    run = fit(module, datamodule=idioms.TileData(x.double(), seg), devices=world, strategy=strategy,
              callbacks=[kfac, probe], max_steps=4, max_epochs=4, precision="64-true", use_distributed_sampler=False)
    pre = kfac.preconditioner
    assert pre is not None
    return {"params": run.params, "compiled": probe.state, "steps": pre.steps,
            "layers": sorted((h.name.replace("_orig_mod.", ""), type(h).__name__) for h in pre.handlers)}


@pytest.mark.parametrize("parts", [pytest.param((2, 1), id="2x1"),
                                   pytest.param((1, 2), id="1x2", marks=pytest.mark.slow)])
def test_compiled_se_block_under_kfac_equals_one_process(parts):
    """A user's squeeze-and-excitation CNN (a tiled convolution, two Linear layers on the pooled gate, a 1x1 head),
    compiled, K-FAC on every layer: the Linear layers' hooks (on replicated values) are idle in the compiled graph
    as well and capture on the eager factor-update steps. Equal to one process in float64."""
    ref = _image_run(0, 1, None, False)
    assert ref["steps"] == 4
    results = run_in_processes(_image_run, 2, parts, True, timeout_s=600, collective_timeout_s=120)
    for rank, res in enumerate(results):
        what = f"se_block at {parts}, rank {rank}"
        assert [n for n, _ in res["layers"]] == [n for n, _ in ref["layers"]], (what, res["layers"], ref["layers"])
        assert ("model.fc1", "LinearHandler") in res["layers"], res["layers"]
        err = _max_error(res, ref)
        assert err <= TOL, f"{what}: parameters differ from one process by {err:.3g}"
        assert res["compiled"] == {"kind": "SplitCompiledForward", "route": "CompiledUnderKFAC", "traces": 1,
                                   "graphs": 1, "eager_calls": 2, "refused": None}, (what, res["compiled"])

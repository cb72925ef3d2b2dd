"""A ``torch.compile``'d model under the K-FAC callback (``self.model = torch.compile(self.model)``): one compiled
graph, as without K-FAC, on the steps K-FAC does not capture, and the model's own forward on its factor-update
steps (:mod:`lightning_hpc.kfac.compiled`); ``Trainer.fit`` equals the eager model under K-FAC in float64.

Without that route dynamo traces K-FAC's hooks into the forward: a graph break at every layer (many graphs for one
forward) and a recompile when the step counter they read changes. Negative controls: with the route detached, the
same fit compiles many graphs; with the factor-update steps sent down the compiled route as well, K-FAC's hooks are
idle on every forward and it refuses at its first factor step, for want of statistics.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.kfac import compiled as compiled_route
from lightning_hpc.kfac.callback import KFAC
from tests.fit_harness import fit

STEPS = 6
KFAC_OPTIONS = dict(factor_update_freq=2, inv_update_freq=2, damping=0.01, kl_clip=0.01,
                    decomposition_dtype="float64")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).double()


class Graphs:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs each as captured."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.count += 1
        return gm.forward


class Classifier(pl.LightningModule):
    def __init__(self, backend: Graphs | None) -> None:
        super().__init__()
        self.model = _net()
        if backend is not None:
            self.model = torch.compile(self.model, backend=backend)
        self.eager_calls: int | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_train_end(self) -> None:  # before the callback's teardown gives the compiled module its forward back
        self.eager_calls = getattr(self.model.forward, "eager_calls", None)
        # a copy made meanwhile (weight averaging's) is not K-FAC's: no route, no preconditioner
        self.copied_forward = type(copy.deepcopy(self.model).__dict__.get("forward")).__name__

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * STEPS, 3, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (4 * STEPS,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _fit(backend: Graphs | None, **kw):
    torch._dynamo.reset()
    module = Classifier(backend)
    run = fit(module, _data(), callbacks=[KFAC(**KFAC_OPTIONS)], max_steps=STEPS, max_epochs=1, **kw)
    return module, run


def test_compiled_model_under_kfac_is_one_graph_and_trains_as_the_eager_model():
    _, ref = _fit(None)
    backend = Graphs()
    module, run = _fit(backend)
    for p, q in zip(run.params, ref.params):
        assert float((p - q).abs().max()) <= 1e-12
    assert backend.count == 1, f"{backend.count} graphs: the hooks reached the compiled forward"
    assert module.eager_calls == STEPS // 2  # the factor-update steps 0, 2, 4
    assert module.copied_forward != "CompiledUnderKFAC", module.copied_forward
    assert "forward" not in module.model.__dict__ or not isinstance(module.model.forward,
                                                                    compiled_route.CompiledUnderKFAC)


@pytest.mark.slow  # dynamo compiles every piece: the longest of these tests
def test_without_the_route_the_hooks_break_the_graph(monkeypatch):
    monkeypatch.setattr("lightning_hpc.kfac.callback.attach_compiled", lambda pre, model: [])
    backend = Graphs()
    _fit(backend)
    assert backend.count > 5, backend.count  # a graph piece between every pair of hooked layers, and recompiles


def test_compiling_the_capture_steps_too_leaves_kfac_without_statistics(monkeypatch):
    monkeypatch.setattr(compiled_route.CompiledUnderKFAC, "captures", lambda self: False)
    _, run = _fit(Graphs(), refusal_is_result=True)
    assert run.error is not None and "none of the hooks" in run.error, run.error
    assert run.steps == 0


def plain_loop(device: str, compiled: bool) -> tuple[list[torch.Tensor], int, int]:
    """A plain training loop (no Lightning): ``KFACPreconditioner`` and ``attach_compiled`` on a compiled model, on
    ``device`` in float64; the final parameters, the graphs dynamo captured and the forwards run eagerly."""
    from lightning_hpc.kfac import KFACPreconditioner

    torch._dynamo.reset()
    net = _net().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(net, optimizer=opt, announce=False, **KFAC_OPTIONS)
    backend = Graphs()
    model: nn.Module = net
    routes: list[compiled_route.CompiledUnderKFAC] = []
    if compiled:
        model = torch.compile(net, backend=backend)
        routes = compiled_route.attach_compiled(pre, model)
        assert len(routes) == 1
    for x, y in _data():
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        pre.step()
        opt.step()
    compiled_route.detach_compiled(routes)
    eager = routes[0].eager_calls if routes else 0
    return [p.detach().cpu() for p in net.parameters()], backend.count, eager


def test_a_plain_training_loop_attaches_the_route():
    params, graphs, eager = plain_loop("cpu", compiled=True)
    ref, _, _ = plain_loop("cpu", compiled=False)
    assert graphs == 1 and eager == STEPS // 2, (graphs, eager)
    for p, q in zip(params, ref):
        assert float((p - q).abs().max()) <= 1e-12


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()

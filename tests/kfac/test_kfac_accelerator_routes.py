"""The routes a GPU takes for the factor Grams, run on the CPU (``linalg.accelerator_routes``), give the CPU routes'
factors; and the chunk bound is the accelerator's there.

On CUDA every Gram is one product per chunk of :data:`ACCELERATOR_GRAM_ELEMENTS` (no cache blocking, no BLAS
``syrk``, no shifted correlations, no depthwise row pairs): the same sums in another order. The GPU tier runs them on
a GPU; here the CPU proves them equal to the CPU's own routes in float64 on every layer type those routes split on.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner, linalg


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # stride 1, zero padding: the CPU's shifted correlations
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),  # depthwise: the CPU's row pairs
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),  # the unfolded patches on both
        nn.Conv2d(16, 16, 1),  # 1x1: per-sample Grams of contiguous rows
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    ).double()


def _factors(accelerator: bool) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _model()
    x = torch.randn(6, 3, 20, 20, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=1, lr=0.1, announce=False)
    with linalg.accelerator_routes() if accelerator else contextlib.nullcontext():  # the hooks form the Grams
        F.cross_entropy(model(x), y).backward()
        pre.step()
    return {name: {k: v.clone() for k, v in f.items()} for name, f in pre.factors.items()}


def test_accelerator_routes_give_the_cpu_factors() -> None:
    cpu, accel = _factors(False), _factors(True)
    assert cpu.keys() == accel.keys() and len(cpu) == 6  # 0, 1 (BatchNorm), 3, 4, 5, 8
    for name in cpu:
        for k in cpu[name]:
            torch.testing.assert_close(accel[name][k], cpu[name][k], rtol=1e-12, atol=1e-12, msg=f"{name}.{k}")


def test_the_routes_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(2)
    assert linalg.cache_blocked(t) and linalg.gram_chunk_elements(t) == linalg.GRAM_CHUNK_ELEMENTS
    with linalg.accelerator_routes():
        assert not linalg.cache_blocked(t)
        assert linalg.gram_chunk_elements(t) == linalg.ACCELERATOR_GRAM_ELEMENTS
    assert linalg.cache_blocked(t)


def test_cpu_routes_differ_from_the_accelerator_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above compares two routes, not one route twice: the CPU takes the shifted correlations and
    the row pairs, the accelerator's routes do not (negative control on what each side calls)."""
    calls: list[str] = []
    for name in ("conv_patch_gram", "depthwise_patch_gram"):
        real = getattr(linalg, name)

        def spy(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*args, **kwargs)

        for module in ("lightning_hpc.kfac.layers.conv", "lightning_hpc.kfac.layers.grouped"):
            mod = __import__(module, fromlist=["x"])
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, spy)
    import lightning_hpc.kfac.layers.conv as conv

    monkeypatch.setattr(conv, "SHIFTED_GRAM_MIN_WORK", 0)
    _factors(False)
    assert set(calls) == {"conv_patch_gram", "depthwise_patch_gram"}
    calls.clear()
    _factors(True)
    assert calls == []


@pytest.mark.parametrize(("case", "pads"), [("mobilenet", False), ("signal", True), ("text", False)])
def test_fit_on_the_accelerator_routes_equals_the_cpu_routes(case: str, pads: bool, tmp_path, monkeypatch) -> None:
    """``Trainer.fit`` with the ``KFAC`` callback on user-written models (``user_modules_run.py``:
    depthwise-separable blocks with BatchNorm, a Conv1d net with InstanceNorm1d, Embedding + LayerNorm), once on the
    CPU's routes and once on an accelerator's (one Gram product per chunk; small layers of different shapes in
    padded buckets, which only the signal net has): the trained parameters agree in float64 (the same terms summed
    in another order)."""
    import sys
    from pathlib import Path

    from lightning_hpc.kfac.methods import ComputeMethod

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from user_modules_run import run

    padded_calls = [0]
    real_padded = ComputeMethod.padded

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        padded_calls[0] += 1
        return real_padded(self, *args, **kwargs)

    monkeypatch.setattr(ComputeMethod, "padded", counting)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "accel").mkdir()
    run(1, tmp_path / "cpu", case)
    assert padded_calls[0] == 0
    with linalg.accelerator_routes():
        run(1, tmp_path / "accel", case)
    assert (padded_calls[0] > 0) == pads
    cpu = torch.load(tmp_path / "cpu" / f"{case}.pt", weights_only=False)
    accel = torch.load(tmp_path / "accel" / f"{case}.pt", weights_only=False)
    assert cpu["registered"] == accel["registered"] and cpu["steps"] == accel["steps"] > 0
    for name, p in cpu["params"].items():
        torch.testing.assert_close(accel["params"][name], p, rtol=1e-9, atol=1e-9, msg=name)

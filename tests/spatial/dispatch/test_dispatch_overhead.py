"""Per-op Python work of the op dispatch that is waste, not dispatch: asking a split tensor its number of
dimensions goes through no ``__torch_function__`` (the handlers ask it several times per op), a layer's call on a
split activation does not go through ``nn.Module.__setattr__``, and the element-wise ops' broadcasting of global
shapes (plain Python, not torch's symbolic-shape version) agrees with ``torch.broadcast_shapes``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.spatial.dispatch import SpatialTensor, elementwise, split_tensor
from lightning_hpc.spatial.layout.tiling import SpatialGrid


def _counting(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = SpatialTensor.__torch_function__.__func__  # type: ignore[attr-defined]

    def count(cls, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(SpatialTensor, "__torch_function__", classmethod(count))
    return seen


def test_dim_is_not_dispatched(monkeypatch):
    x = split_tensor(torch.randn(2, 3, 5, 4), SpatialGrid.single(), (2, 3, 10, 4))
    seen = _counting(monkeypatch)
    assert x.dim() == 4
    assert "dim" not in seen, seen
    assert x.sum(dim=0).shape == (3, 10, 4) and "sum" in seen, seen  # the counter sees what is dispatched


def test_layer_call_does_not_set_module_attributes(monkeypatch):
    """A convolution on a split activation (the dispatch's handler and the tile kernel) writes no module attribute
    through ``nn.Module.__setattr__`` (which checks parameters, buffers and submodules on every write)."""
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = split_tensor(torch.randn(2, 3, 6, 5), SpatialGrid.single(), (2, 3, 6, 5))
    writes: list[str] = []
    real = nn.Module.__setattr__
    monkeypatch.setattr(nn.Module, "__setattr__", lambda self, name, value: (writes.append(name), real(self, name,
                                                                                                         value))[1])
    out = conv(x)
    assert out.shape == (2, 4, 6, 5) and writes == [], writes


@pytest.mark.parametrize("shapes", [
    [(2, 3, 13, 11), (3, 1, 1)], [(2, 1, 13, 11), (1, 4, 13, 11)], [(13, 11), (2, 3, 13, 11), ()],
    [(2, 0, 5, 5), (1, 1, 5)], [(2, 3, 13, 11), (2, 3, 12, 11)], [(3, 4), (2, 4)],
])
def test_broadcast_matches_torch(shapes):
    try:
        expected = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        expected = None
    assert elementwise._broadcast(shapes) == expected


def test_parameter_names_are_listed_only_when_a_message_needs_them():
    """The strategy's per-step parameter-use check names parameters only in its refusals."""
    from lightning_hpc.spatial.dispatch.parameter_check import ParameterNames, ParameterUseCheck

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2))
    walks: list[int] = []
    real = model.named_parameters
    model.named_parameters = lambda *a, **k: (walks.append(1), real(*a, **k))[1]  # type: ignore[method-assign]
    names = ParameterNames(model)
    check = ParameterUseCheck({}, names)
    with check:
        model[1](torch.randn(2, 4)).sum()
    check.raise_if_mixed(names)
    assert walks == []
    assert names.get(id(model[1].weight)) == "1.weight" and names.get(12345, "?") == "?" and walks == [1]

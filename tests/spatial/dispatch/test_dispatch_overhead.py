"""Per-op Python work of the op dispatch that is waste, not dispatch: asking a split tensor its number of
dimensions goes through no ``__torch_function__`` (the handlers ask it several times per op), a layer's call on a
split activation does not go through ``nn.Module.__setattr__``, and the element-wise ops' broadcasting of global
shapes (plain Python, not torch's symbolic-shape version) agrees with ``torch.broadcast_shapes``."""

from __future__ import annotations

import cProfile
import pstats

import pytest
import torch
import torch.nn.functional as F
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


def _python_calls(fn) -> int:
    """Python function calls (and builtin calls) made by ``fn()``, as cProfile counts them."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def _ops_dispatched(monkeypatch, fn) -> int:
    with monkeypatch.context() as m:
        seen = _counting(m)
        fn()
    return len(seen)


def _per_op(monkeypatch, step) -> float:
    """Python calls per dispatched op of ``step(split)``: the split step's calls less the plain step's, per op the
    dispatch saw (after two warm-up steps of each: binders and decisions are made once)."""
    for split in (False, True, False, True):
        step(split)
    ops = _ops_dispatched(monkeypatch, lambda: step(True))
    return (_python_calls(lambda: step(True)) - _python_calls(lambda: step(False))) / ops


def test_python_calls_per_dispatched_op(monkeypatch):
    """A training step of convolution / batch norm / ReLU blocks (the mesh FCN's ops) and a mean loss on ONE tile:
    the Python work the dispatch adds per op it sees (torch's ``__torch_function__`` protocol, the route, the
    handler, the tile's plain alias and the wrap of the result): 41.5 calls per op on this network (36 on the mesh
    FCN at 128^2, ``bench/spatial_dispatch.py``) before the route was read in ``__torch_function__`` itself and the
    hot handlers lost their per-operand calls, 31 after (25 on the mesh FCN)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for c in (3, 4) for m in (nn.Conv2d(c, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                                                      nn.ReLU(inplace=True))], nn.Conv2d(4, 1, 1))
    x, y = torch.randn(2, 3, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).float()
    grid = SpatialGrid.single()

    def step(split: bool) -> None:
        xs, ys = (split_tensor(t, grid, tuple(t.shape)) if split else t for t in (x, y))
        net.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(net(xs), ys).backward()

    assert _per_op(monkeypatch, step) <= 34


@pytest.mark.parametrize("op", ["relu", "relu_inplace", "add", "scale"])
def test_elementwise_on_tiles_alike_is_one_lookup(monkeypatch, op):
    """An element-wise op whose tensor operands are all split tensors laid out alike: the route is one table
    lookup and the operands are checked inline, so the dispatch adds a fixed handful of calls to the op (torch's
    ``handle_torch_function`` for a Python functional such as ``F.relu``, the route's lookup, the element-wise
    path and the context that hands the kernel plain tiles).  Calls per op before / after: ``F.relu`` 29 / 15,
    in place 23 / 13, a sum of two tiles 21 / 11, a tile times a number 21 / 7 (before: a call per operand check,
    per plain operand and per wrap)."""
    x = torch.randn(2, 3, 8, 8)
    xs = split_tensor(x, SpatialGrid.single(), tuple(x.shape))
    y, ys = x.clone(), xs.clone()  # (changed in place)
    calls = {"relu": lambda t, u: F.relu(t), "relu_inplace": lambda t, u: F.relu(u, inplace=True),
             "add": lambda t, u: t + u, "scale": lambda t, u: t * 2.0}[op]

    def step(split: bool) -> None:
        calls(xs, ys) if split else calls(x, y)

    bound = {"relu": 18, "relu_inplace": 16, "add": 14, "scale": 10}[op]
    assert _per_op(monkeypatch, step) <= bound


def test_batch_norm_on_one_tile_runs_torch_batch_norm(monkeypatch):
    """A batch norm on one tile: the handler checks what ``F.batch_norm`` checks against the global shape and calls
    ``torch.batch_norm`` itself, with the layer's operands recorded inline (39 calls per op before, 33 after)."""
    bn = nn.BatchNorm2d(3)
    x = torch.randn(2, 3, 8, 8)
    xs = split_tensor(x, SpatialGrid.single(), tuple(x.shape))

    def step(split: bool) -> None:
        bn(xs if split else x)

    assert _per_op(monkeypatch, step) <= 34


@pytest.mark.parametrize(("training", "eps", "shape"), [(True, 0.0, (2, 3, 4, 4)), (False, -1e-5, (2, 3, 4, 4)),
                                                         (True, 1e-5, (1, 3, 1, 1))])
def test_batch_norm_on_tiles_refuses_what_the_serial_op_refuses(training, eps, shape):
    """The checks ``F.batch_norm`` makes before its kernel (a positive ``eps`` in training, a non-negative one
    otherwise, more than one value per channel in training) hold on a split input, with the serial op's message."""
    x = torch.randn(*shape)
    xs = split_tensor(x, SpatialGrid.single(), tuple(x.shape))
    stats = (torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError) as serial:
        F.batch_norm(x, *stats, training=training, eps=eps)
    with pytest.raises(ValueError) as split:
        F.batch_norm(xs, *stats, training=training, eps=eps)
    assert str(split.value) == str(serial.value)

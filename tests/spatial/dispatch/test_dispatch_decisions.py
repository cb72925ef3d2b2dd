"""The op dispatch decides once per distinct call and replays: a call's binding is decided once per call shape
(and equals ``inspect.Signature.bind``), a convolution's plan and an element-wise call's operand roles are cached
on the grid by (op, layouts, shapes, non-tensor arguments), a repeated training step makes no new decision, and
a decision is never reused for another layout or shape (with the shape left out of the key, the check below
fails: the negative control)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import elementwise, split_tensor
from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.calls import bind_call
from lightning_hpc.spatial.dispatch.state import state
from lightning_hpc.spatial.layout.tiling import SpatialGrid, create_hybrid_layout
from lightning_hpc.spatial.layout.tracing import Trace


def _reference_bind(op, args, kwargs):
    try:
        bound = inspect.signature(op).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _var(input, dim=None, *_, **__): ...  # noqa: E704
def _conv(input, weight, bias=None, stride=1, padding=0): ...  # noqa: E704
def _posonly(a, /, b, *, c=3): ...  # noqa: E704
def _mixed(x, *rest, k=1, **kw): ...  # noqa: E704


@pytest.mark.parametrize("op,args,kwargs", [
    (_var, (1,), {}), (_var, (1, 2, 3), {"dtype": 4}), (_var, (1,), {"dim": 2, "z": 5}),
    (_conv, (1, 2), {}), (_conv, (1,), {"weight": 2, "padding": 3}), (_conv, (1, 2, 3, 4, 5, 6), {}),
    (_conv, (), {"input": 1}), (_conv, (1, 2), {"nope": 1}), (_posonly, (1, 2), {"c": 4}),
    (_posonly, (), {"a": 1, "b": 2}), (_mixed, (1, 2, 3), {"k": 2, "q": 3}), (_mixed, (1,), {}),
    (F.batch_norm, (1, 2, 3), {"training": True}),
])
def test_cached_binding_equals_signature_bind(op, args, kwargs):
    for _ in range(2):  # decided, then replayed
        assert bind_call(op, args, kwargs) == _reference_bind(op, args, kwargs)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = h + self.b(h)
        return F.max_pool2d(h * 0.5, 2)


def test_a_repeated_step_makes_no_new_decision():
    torch.manual_seed(0)
    net, grid = _Net(), SpatialGrid.single()
    x = torch.randn(2, 3, 8, 8)

    def step():
        net(split_tensor(x, grid, tuple(x.shape))).sum(dim=(0, 1, 2, 3)).backward()

    step()
    first = grid.decisions.made
    step()
    # two convolutions of different weights: two plans; the max pool: one plan (relu, the residual sum of two
    # tiles laid out alike and the scaling by a number decide nothing: the op runs on the tiles as they are)
    assert first == 3 and grid.decisions.made == first, (first, grid.decisions.made)
    other = SpatialGrid.single()  # another grid (another Trainer's): its own cache, nothing shared
    net(split_tensor(x, other, tuple(x.shape))).sum(dim=(0, 1, 2, 3)).backward()
    assert other.decisions.made == first and grid.decisions.made == first


def _serial_and_split(rank, world, parts, calls):
    """Each call ``(x_shape, plain_shape)``: ``x * plain`` on a split ``x`` against the serial product, in order on
    one grid, so a decision made for an earlier call is in the cache when a later one runs."""
    grid = create_hybrid_layout(parts).grid
    errs = []
    for k, (xs, ps) in enumerate(calls):
        g = torch.Generator().manual_seed(k)
        x, plain = torch.randn(xs, generator=g), torch.randn(ps, generator=g)
        sdims = tuple(range(len(xs) - len(parts), len(xs)))
        tile = x[_tile_index(x.shape, sdims, grid)]
        conv = nn.Conv2d(xs[1], 2, 3, padding=1)
        for split, serial, shape in (
                (lambda: split_tensor(tile, grid, xs, sdims) * plain, lambda: x * plain, xs),
                (lambda: conv(split_tensor(tile, grid, xs, sdims)), lambda: conv(x), (xs[0], 2, *xs[2:]))):
            want = serial()[_tile_index(shape, sdims, grid)]
            try:
                got = split().local()
            except RuntimeError:  # a wrong decision may also fail outright
                got = None
            errs.append(float((got - want).abs().max()) if got is not None and got.shape == want.shape
                        else float("inf"))
    return errs


# the same split operand, with a plain operand broadcast along W, then spanning W (cut to the tile), then with
# another split extent: each must be decided afresh
_CALLS = [((2, 3, 6, 8), (3, 1, 1)), ((2, 3, 6, 8), (3, 6, 8)), ((2, 3, 6, 10), (1, 6, 10)), ((2, 3, 6, 8), (8,))]


def test_a_decision_is_not_reused_for_another_layout_or_shape():
    errs = run_in_processes(_serial_and_split, 2, (1, 2), _CALLS, timeout_s=120)
    assert max(max(e) for e in errs) < 1e-5, errs


def _without_shapes(rank, world, parts, calls):
    elementwise._operand_key = lambda a: None  # the key no longer tells the operands' layouts and shapes apart
    return _serial_and_split(rank, world, parts, calls)


def test_negative_control_a_key_without_shapes_reuses_wrong_decisions():
    errs = run_in_processes(_without_shapes, 2, (1, 2), _CALLS, timeout_s=120)
    assert max(max(e) for e in errs) > 1e-3, errs


# pairs of calls on one split input that differ in one argument only, the second decided after the first:
# dilation (a "same" convolution of the same weight shape), ceil_mode (max and average pooling) and align_corners
# (bilinear interpolation): each argument must be part of the call's decision key
_ARGUMENT_PAIRS = [
    ("conv dilation", lambda x, w: F.conv2d(x, w, padding="same"),
     lambda x, w: F.conv2d(x, w, padding="same", dilation=2)),
    ("max_pool ceil_mode", lambda x, w: F.max_pool2d(x, 2, 2), lambda x, w: F.max_pool2d(x, 2, 2, ceil_mode=True)),
    ("avg_pool ceil_mode", lambda x, w: F.avg_pool2d(x, 2, 2), lambda x, w: F.avg_pool2d(x, 2, 2, ceil_mode=True)),
    ("interpolate align_corners",
     lambda x, w: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
     lambda x, w: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)),
]


def _argument_pairs(rank, world, parts):
    """Per pair: the max abs error of both calls' output tiles against the serial ops (float64, the second call
    after the first on one grid); inf where a call gives the wrong shape or fails."""
    grid = create_hybrid_layout(parts).grid
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 11, generator=g, dtype=torch.float64)
    w = torch.randn(3, 3, 3, 3, generator=g, dtype=torch.float64)
    sdims = (2, 3)
    tile = x[_tile_index(x.shape, sdims, grid)]
    errs = {}
    for name, first, second in _ARGUMENT_PAIRS:
        worst = 0.0
        for call in (first, second):
            want = call(x, w)
            want = want[_tile_index(want.shape, sdims, grid)]
            try:
                got = call(split_tensor(tile, grid, x.shape, sdims), w).local()
            except RuntimeError:  # a wrong decision may also fail outright
                got = None
            worst = max(worst, float((got - want).abs().max()) if got is not None and got.shape == want.shape
                        else float("inf"))
        errs[name] = worst
    return errs


def test_a_decision_is_not_reused_for_another_dilation_ceil_mode_or_align_corners():
    """Two calls that differ only in one non-tensor argument (the input's layout and shapes and the weight's shape
    the same) are decided apart: a "same" convolution with dilation 1 then 2, max and average pooling without and
    with ``ceil_mode`` on an odd extent, bilinear interpolation without and with ``align_corners``."""
    for parts in ((2, 1), (1, 2)):
        for errs in run_in_processes(_argument_pairs, 2, parts, timeout_s=120):
            assert max(errs.values()) < 1e-12, (parts, errs)


def _sum_of_two_layouts(rank, world):
    """``a + b`` for split tensors of one global shape laid out otherwise (``b`` split along W by the grid's first
    axis, ``a`` along H), and ``a + a2`` for two laid out alike, against the serial sums."""
    grid = create_hybrid_layout((2, 1)).grid
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(2, 3, 6, 6, generator=g) for _ in range(3))
    a = split_tensor(x[_tile_index(x.shape, (2, 3), grid)], grid, x.shape, (2, 3))
    a2 = split_tensor(z[_tile_index(z.shape, (2, 3), grid)], grid, z.shape, (2, 3))
    b = split_tensor(y[_tile_index(y.shape, (3, 2), grid)], grid, y.shape, (3, 2))
    return float(((a + b).full() - (x + y)).abs().max()), float(((a + a2).full() - (x + z)).abs().max())


def test_tiles_laid_out_otherwise_are_not_combined_as_they_are():
    """The element-wise path that runs an op on the tiles as they are takes only operands laid out alike; two
    split tensors of one global shape split along different dimensions are not added block by block (which would
    add entries of different positions)."""
    for errs in run_in_processes(_sum_of_two_layouts, 2, timeout_s=120):
        assert max(errs) < 1e-6, errs


def test_inplace_keyword_is_part_of_the_decision():
    """``F.relu(x)`` then ``F.relu(x, inplace=True)`` on the same layout: the second changes ``x`` itself (a key
    without the keyword's value replays the out-of-place decision and leaves ``x`` unchanged)."""
    grid = SpatialGrid.single()
    x = split_tensor(torch.randn(2, 3, 4, 4), grid, (2, 3, 4, 4))
    out = F.relu(x)
    assert (x.local() < 0).any() and (out.local() >= 0).all()
    same = F.relu(x, inplace=True)
    assert same is x and (x.local() >= 0).all()


def test_inplace_keyword_is_part_of_the_decision_while_a_step_is_traced():
    """While a split step is traced, every element-wise call is decided (operands laid out alike take no shortcut):
    ``F.relu(x, inplace=False)`` then ``F.relu(x, inplace=True)`` on the same layout, whose keywords differ in value
    only, are decided apart, and the second changes ``x`` itself."""
    grid = SpatialGrid.single()
    x = split_tensor(torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)), grid, (2, 3, 4, 4))
    Trace.active = True
    try:
        out = F.relu(x, inplace=False)
        kept = bool((x.local() < 0).any()) and bool((out.local() >= 0).all())
        same = F.relu(x, inplace=True)
    finally:
        Trace.active = False
    assert kept and same is x and (x.local() >= 0).all()
    assert grid.decisions.made == 2


def test_backward_under_a_dispatch_mode_meets_no_split_tensor():
    """What autograd saves for backward from the ops that skip the decisions (element-wise on tiles laid out alike,
    the replayed convolution) is plain: a dispatch mode seeing backward's ops (FlopCounterMode, as Lightning's
    ``measure_flops`` uses) counts the same FLOPs as on plain tensors and nothing is gathered (a saved split
    tensor would send backward's aten ops through the op dispatch, which gathers them)."""
    torch.manual_seed(0)
    net, grid = _Net(), SpatialGrid.single()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 4, 4)

    def flops(split: bool) -> int:
        before = state().gathers
        with FlopCounterMode(display=False) as counter:
            xs, ys = (split_tensor(t, grid, tuple(t.shape)) if split else t for t in (x, y))
            (net(xs) * ys).sum(dim=(0, 1, 2, 3)).backward()
        assert state().gathers == before
        return counter.get_total_flops()

    assert flops(True) == flops(False) > 0

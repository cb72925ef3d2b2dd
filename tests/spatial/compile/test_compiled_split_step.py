"""``torch.compile`` of a split model (:mod:`lightning_hpc.spatial.compile`): the forward is one graph of tile
operations (no graph break per op: one dynamo graph, halo exchanges and group sums as operators in it), traced
once per input layout and replayed, and the step equals one process's (float64, outputs and gradients, 2-D and
3-D splits).  What has no traceable form runs eagerly, exactly, and is named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.compile import SplitCompiledForward
from lightning_hpc.spatial.dispatch import split_tensor
from lightning_hpc.spatial.dispatch.state import state
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices


class Net2d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(6, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.ReLU())
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        h = self.body(x)
        return self.head(h + F.avg_pool2d(h, 3, 1, 1))


class Net3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU())
        self.down = nn.Sequential(nn.MaxPool3d(2), nn.Conv3d(4, 4, 3, padding=1), nn.ReLU())
        self.out = nn.Conv3d(8, 2, 1)

    def forward(self, x):
        e = self.enc(x)
        d = F.interpolate(self.down(e), scale_factor=2, mode="nearest")
        return self.out(torch.cat([e, d], dim=1))


class WithDropout(Net2d):
    def forward(self, x):
        return self.head(F.dropout(self.body(x), 0.5))


class SqueezeExcite(Net2d):
    """A gate computed on replicated values (global pooling, two Linear layers) multiplied into the tiles: its
    gradient is completed over the group, which the dispatch decides by ``requires_grad`` (traced with grad on)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 3), nn.Linear(3, 6)

    def forward(self, x):
        h = self.body(x)
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(h.mean((2, 3))))))
        return self.head(h * gate[:, :, None, None])


class GatheredOps(Net2d):
    """Ops with no tiled form, computed on the gathered whole activation: a cumulative sum along a split dimension
    (its result split again, its gradient summed over the group) and a Flatten + Linear head (every rank computes
    it whole; the gather's adjoint keeps this tile's part)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Identity()
        self.fc = nn.Linear(6 * 6 * 5, 4)

    def forward(self, x):
        h = torch.cumsum(self.body(x), dim=2) / 8.0
        return self.fc(torch.flatten(h, 1))


class RankBranch(Net2d):
    """A forward dynamo captures on some ranks only: a graph break where ``breaks`` is set (on rank 0 in
    :func:`_run`), as Python that branches on the rank makes one (a ``print`` on rank 0)."""

    breaks = False

    def forward(self, x):
        if self.breaks:
            torch._dynamo.graph_break()
        return super().forward(x)


MODELS = {
    "net2d": (Net2d, (2, 3, 12, 10)), "se": (SqueezeExcite, (2, 3, 12, 10)), "net3d": (Net3d, (2, 2, 8, 6, 6)),
    "dropout": (WithDropout, (2, 3, 12, 10)), "gathered": (GatheredOps, (2, 3, 12, 10)),
    "rank_branch": (RankBranch, (2, 3, 12, 10)),
}


def _model(name):
    torch.manual_seed(0)
    return MODELS[name][0]().double()


def _step(forward, x, model):
    for p in model.parameters():
        p.grad = None
    out = forward(x)
    out.square().sum().backward()
    return out


def _run(rank, world, parts, name, shapes, backend):
    cls_shape = MODELS[name][1]
    results = []
    grid = create_hybrid_layout(parts).grid
    model = _model(name)
    model.breaks = rank == 0  # (read by RankBranch only)
    compiled = SplitCompiledForward(torch.compile(model, backend=backend))
    for shape in shapes:
        torch.manual_seed(1)
        x = torch.randn(*(shape or cls_shape), dtype=torch.float64)
        ref_model = _model(name)
        ref_model.load_state_dict(model.state_dict())
        tile = x[(Ellipsis, *tile_slices(x.shape[2:], grid.parts, grid.index))].contiguous()
        for step in range(2):  # the second call replays the program the first traced
            torch.manual_seed(10 + step)  # the same random stream for both (the dropout model)
            ref = _step(ref_model, x, ref_model)
            torch.manual_seed(10 + step)
            out = _step(compiled, split_tensor(tile, grid, x.shape), model)
        grads = []
        for p, r in zip(model.parameters(), ref_model.parameters()):
            g = p.grad.clone()
            if id(p) in grid.tile_params:  # partial sums over the tiles (the strategy sums them)
                dist.all_reduce(g, group=grid.group)
            grads.append(float((g - r.grad).abs().max()))
        buffers = max((float((b - r).abs().max()) for b, r in zip(model.buffers(), ref_model.buffers())
                       if b.is_floating_point()), default=0.0)
        whole = out.full() if hasattr(out, "full") else out  # a replicated output (the Flatten + Linear head)
        results.append({"out": float((whole - ref).abs().max()), "grads": max(grads), "buffers": buffers})
    return {"results": results, "traces": compiled.traces, "graphs": compiled.graphs, "refused": compiled.refused,
            # the running statistics after compiled steps are plain values, as after eager ones (torch 2.14 hands
            # a graph's buffer update over with its autograd history; the next capture then refused the step)
            "buffers_need_grad": [n for n, b in model.named_buffers() if b.requires_grad]}


@pytest.mark.parametrize(
    ("name", "parts"),
    [("net2d", (2, 1)), ("net2d", (1, 2)), ("se", (2, 1)), ("net3d", (2, 1, 1)), ("gathered", (2, 1)),
     ("gathered", (1, 2))],
    ids=["2d-2x1", "2d-1x2", "se-2x1", "3d-2x1x1", "gathered-2x1", "gathered-1x2"])
def test_compiled_split_step_equals_one_process(name, parts):
    for res in run_in_processes(_run, 2, parts, name, [None], "eager", timeout_s=300):
        assert res["refused"] is None, res["refused"]
        # one dynamo graph for the whole forward (no graph break), one trace: the second step replays it
        assert (res["graphs"], res["traces"]) == (1, 1), res
        assert res["buffers_need_grad"] == [], res
        for r in res["results"]:
            assert r["out"] < 1e-12 and r["grads"] < 1e-10 and r["buffers"] < 1e-12, r


def test_another_shape_is_traced_again_and_exact():
    """A program is kept per input layout: a second global shape is a second graph and a second trace, both
    exact (a program replayed on another shape's tiles would compute the first shape's windows)."""
    res = run_in_processes(_run, 2, (2, 1), "net2d", [(2, 3, 12, 10), (2, 3, 16, 10)], "eager", timeout_s=300)[0]
    assert res["refused"] is None and res["traces"] == 2 and res["graphs"] == 2, res
    for r in res["results"]:
        assert r["out"] < 1e-12 and r["grads"] < 1e-10, r


def test_ops_computed_whole_on_uneven_tiles_are_exact():
    """The gathered ops of :class:`GatheredOps` on 13 rows split 7 / 6 (the gather pads the smaller tile to the
    larger one's size and places each at its bounds; the cut result is uneven too): one graph, exact."""
    res = run_in_processes(_run, 2, (2, 1), "gathered", [(2, 3, 13, 10)], "eager", timeout_s=300)[0]
    assert res["refused"] is None and (res["graphs"], res["traces"]) == (1, 1), res
    for r in res["results"]:
        assert r["out"] < 1e-12 and r["grads"] < 1e-10, r


def _gather_counts(rank, world):
    grid = create_hybrid_layout((2, 1)).grid
    model = _model("gathered")
    compiled = SplitCompiledForward(torch.compile(model, backend="eager"))
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 10, dtype=torch.float64)
    tile = x[(Ellipsis, *tile_slices(x.shape[2:], grid.parts, grid.index))].contiguous()
    counts = {}
    for name, forward in (("eager", model), ("compiled 1", compiled), ("compiled 2", compiled),
                          ("compiled 3", compiled)):
        before = (state().gathers, state().gathered_bytes)
        _step(forward, split_tensor(tile, grid, x.shape), model)
        counts[name] = (state().gathers - before[0], state().gathered_bytes - before[1])
    return {"counts": counts, "traces": compiled.traces}


def test_the_gather_counters_count_every_compiled_step_as_an_eager_one():
    """The dispatch's gather counters (``state().gathers``, ``gathered_bytes``) see a compiled step's gathers at
    every call, as many as the eager step's, and none from the trace (which runs the step once more on copies)."""
    for res in run_in_processes(_gather_counts, 2, timeout_s=300):
        counts = res["counts"]
        assert res["traces"] == 1 and counts["eager"][0] > 0, res
        assert counts["compiled 1"] == counts["compiled 2"] == counts["compiled 3"] == counts["eager"], res


def test_random_draws_run_eagerly_and_are_named():
    res = run_in_processes(_run, 2, (2, 1), "dropout", [None], "eager", timeout_s=300)[0]
    assert res["refused"] is not None and "random draw" in res["refused"], res
    for r in res["results"]:
        assert r["out"] < 1e-12 and r["grads"] < 1e-10, r


def test_a_forward_captured_on_one_rank_only_runs_eagerly_on_every_rank():
    """Rank 0's forward is a graph break, rank 1's one graph: the ranks agree before rank 1's trace, so both run
    eagerly (exact), each naming why; without the agreement rank 1 would wait in its trace's first halo exchange
    for a rank that runs the eager ones (a hang until the collective timeout)."""
    first, second = run_in_processes(_run, 2, (2, 1), "rank_branch", [None], "eager", timeout_s=120)
    assert first["refused"] is not None and "graph_break" in first["refused"], first
    assert second["refused"] is not None and "another rank of the spatial group" in second["refused"], second
    assert first["traces"] == second["traces"] == 0, (first, second)
    for res in (first, second):
        for r in res["results"]:
            assert r["out"] < 1e-12 and r["grads"] < 1e-10 and r["buffers"] < 1e-12, r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["net2d", "gathered"])
def test_inductor_compiles_the_split_step(name, tmp_path):
    """The default backend (inductor, C++ kernels on the CPU) compiles the tile program, the gather and cut
    operators included: float64 to 1e-10, and again in new processes from its caches. The caches key a backward
    graph by its forward graph, which both ranks share here: an adjoint that traced this rank's tile bounds into the
    backward graph (the gather's did) gave one rank the other's gradients from the cache (0.30 off)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cache of this test's own, shared by the ranks
    for launch in ("compiled", "from the caches"):  # two process groups: the second loads what the first wrote
        for res in run_in_processes(_run, 2, (2, 1), name, [None], "inductor", timeout_s=600, env=env):
            assert res["refused"] is None and res["traces"] == 1, (launch, res)
            for r in res["results"]:
                assert r["out"] < 1e-10 and r["grads"] < 1e-9, (launch, r)

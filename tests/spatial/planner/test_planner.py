import dataclasses
import json
import math
import random

import pytest
import torch
from torch import nn

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, SyncCost, alphabeta
from lightning_hpc.spatial.planner import (
    CostModel,
    Distribution,
    brute_force_line,
    build_stages,
    candidate_distributions,
    plan_for_model,
    shortest_line_path,
    trace_layers,
)


class FlopTimer(LayerTimer):
    """Deterministic layer times (proportional to multiply-adds) so planner tests do not depend on the load."""

    def __init__(self):
        self._cache, self.calls = {}, 0

    def measure(self, module, input_shape, dtype=torch.float32, device="cpu"):
        self.calls += 1
        elems = 1
        for s in input_shape:
            elems *= s
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1]
            work = elems * module.out_channels * k / (module.stride[0] * module.stride[1])
        elif isinstance(module, nn.Linear):
            work = elems * module.out_features
        else:
            work = elems
        t = 1e-9 * work
        return {"forward": t, "backward": 2 * t}


@pytest.mark.parametrize("seed", range(8))
def test_shortest_path_equals_brute_force(seed):
    rng = random.Random(seed)
    layers = rng.randint(2, 5)
    cands = [[f"d{k}" for k in range(rng.randint(1, 4))] for _ in range(layers)]
    costs = {(i, d): rng.uniform(0, 10) for i, row in enumerate(cands) for d in row}
    shuffles = {}

    def shuffle(i, a, b):
        return 0.0 if a == b else shuffles.setdefault((i, a, b), rng.uniform(0, 5))

    path, total = shortest_line_path(cands, lambda i, d: costs[(i, d)], shuffle)
    ref_path, ref_total = brute_force_line(cands, lambda i, d: costs[(i, d)], shuffle)
    assert total == pytest.approx(ref_total)
    # the returned path really has that length
    again = sum(costs[(i, d)] for i, d in enumerate(path)) + sum(
        shuffle(i, path[i], path[i + 1]) for i in range(layers - 1)
    )
    assert again == pytest.approx(total)


def test_shuffle_cost_can_keep_a_worse_layer_choice():
    # Layer 1 alone prefers B, but switching costs more than it saves: the path stays on A.
    cost = {(0, "A"): 1.0, (0, "B"): 5.0, (1, "A"): 2.0, (1, "B"): 1.5}
    path, total = shortest_line_path(
        [["A", "B"], ["A", "B"]], lambda i, d: cost[(i, d)], lambda i, a, b: 0 if a == b else 1.0
    )
    assert path == ["A", "A"] and total == pytest.approx(3.0)


def _line_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 4, 1),
    )


def test_halo_cost_matches_section_v_a():
    m = AlphaBeta(alpha=1e-5, beta=1e-9)
    stages = build_stages(trace_layers(_line_net(), (2, 3, 32, 32)))
    costs = CostModel(m, world_size=4, batch_size=2, timer=FlopTimer())
    first = stages[0]
    assert [layer.name for layer in first.layers] == ["0", "1", "2"]
    d = Distribution(1, 2, 2)
    sr = lambda n: alphabeta.send_recv(4 * n, m)  # noqa: E731
    # the paper's interior tile gets 2 SR(O n C w) + 2 SR(O n C h) + 4 SR(O^2 n C); a 2 x 2 grid has no interior
    # tile: each tile receives one row strip, one column strip (16 long) and one corner from its 3 neighbours
    n, c, o = 2, 3, 1
    expected = 2 * sr(o * n * c * 16) + sr(o * o * n * c)
    assert costs._halo(first.head, d) == pytest.approx(expected)
    assert costs._halo(first.head, Distribution(4, 1, 1)) == 0.0  # sample parallelism needs no halo
    assert costs._halo(stages[2].head, d) == 0.0  # 1x1 convolution
    sc = costs.stage_cost(first, d)
    assert sc.halo == pytest.approx(expected)  # the input needs no gradient: forward exchange only
    second = stages[1]  # stride-2 3x3 conv on the 32x32 activation: forward and backward exchanges
    # output tile [8, 16) reads input rows [15, 32): one row (and one column) from the first tile, over the 16
    # rows (columns) of its own; the first output tile [0, 8) reads rows [-1, 16), only its own and the padding
    expected2 = 2 * sr(o * n * 8 * 16) + sr(o * o * n * 8)
    assert costs.stage_cost(second, d).halo == pytest.approx(2 * expected2)
    assert sc.bn_stats == pytest.approx(2 * alphabeta.allreduce(2 * 8 * 4, 4, m))
    params = (3 * 8 * 9 + 8) * 4
    assert dict(sc.allreduces)["0"] == pytest.approx(alphabeta.allreduce(params, 4, m))


def test_candidates_respect_batch_and_tile_size():
    stages = build_stages(trace_layers(_line_net(), (2, 3, 8, 8)))
    cands = candidate_distributions(stages[1], world_size=8, batch_size=2)  # stride-2 conv, output 4x4
    assert all(d.n * d.h * d.w == 8 and d.n <= 2 for d in cands)
    assert Distribution(1, 8, 1) not in cands  # 4-row output cannot be split in 8
    assert Distribution(2, 2, 2) in cands


def test_planner_prefers_sample_parallelism_when_halos_are_expensive_and_spatial_when_batch_is_small():
    model, timer = _line_net(), FlopTimer()
    slow = AlphaBeta(alpha=1.0, beta=1e-3)
    plan = plan_for_model(model, (3, 32, 32), 4, batch_size=4, alpha_beta=slow, timer=timer)
    assert set(plan.distributions.values()) == {Distribution(4, 1, 1)} and plan.spatial_parts == (1, 1)
    plan1 = plan_for_model(model, (3, 32, 32), 4, batch_size=1, alpha_beta=AlphaBeta(1e-6, 1e-10), timer=timer)
    assert plan1.sample_groups == 1 and plan1.spatial_parts[0] * plan1.spatial_parts[1] == 4
    assert plan1.method == "shortest-path" and plan1.predicted_step_time > 0
    # pure sample parallelism at N=1 is impossible on 4 processes
    with pytest.raises(ValueError, match="restriction"):
        plan_for_model(
            model, (3, 32, 32), 4, batch_size=1, alpha_beta=slow, timer=timer, restrict=lambda d: d.h == d.w == 1
        )


def test_predicted_time_adds_up_for_sample_parallelism():
    model, timer = _line_net(), FlopTimer()
    m = AlphaBeta(alpha=1e-4, beta=1e-8)
    plan = plan_for_model(
        model, (3, 16, 16), 2, batch_size=2, alpha_beta=m, timer=timer, restrict=lambda d: d.h == d.w == 1
    )
    assert plan.halo_time == 0 and plan.shuffle_time == 0
    compute = sum(c.compute for c in plan.stage_costs.values())
    assert plan.compute_time == pytest.approx(compute)
    hidden = plan.allreduce_time - plan.exposed_allreduce_time
    assert 0 <= hidden <= plan.allreduce_time
    assert plan.predicted_step_time == pytest.approx(compute + plan.exposed_allreduce_time + plan.optimizer_time)
    fused = plan_for_model(
        model,
        (3, 16, 16),
        2,
        batch_size=2,
        alpha_beta=m,
        timer=timer,
        restrict=lambda d: d.h == d.w == 1,
        gradient_reduction="single",
    )
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    assert fused.exposed_allreduce_time == pytest.approx(alphabeta.allreduce(nbytes, 2, m))  # nothing left to hide it


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.skip = nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        return self.head(self.b(torch.relu(self.a(x))) + self.skip(x))


def test_longest_path_first_assigns_every_layer_of_a_branching_net():
    plan = plan_for_model(
        _Residual(), (3, 16, 16), 4, batch_size=2, alpha_beta=AlphaBeta(1e-6, 1e-10), timer=FlopTimer()
    )
    assert plan.method == "longest-path-first"
    names = {"stem", "a", "b", "skip", "head", "add"}
    assert names <= set(plan.distributions)
    assert all(d.n * d.h * d.w * d.replicas == 4 for d in plan.distributions.values())


def test_plan_spatial_cli_json(tmp_path, monkeypatch, capsys):
    from lightning_hpc.cli.plan_spatial import main

    monkeypatch.setenv("LIGHTNING_HPC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    argv = ["recipe=mesh_tangling_1k", "--world-size", "4", "input_shape=[18,64,64]", "model.widths=[4,4,4,4,4,4]",
            "--alpha", "1e-5", "--beta", "1e-9", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"] == "mesh_tangling_1k" and out["world_size"] == 4
    names = [layer["name"] for layer in out["layers"]]
    assert names[0] == "block1.0" and names[-1] == "upsample" and len(names) == 6 * 9 + 2
    for layer in out["layers"]:
        d = layer["distribution"]
        assert d["n"] * d["h"] * d["w"] * d["replicas"] == 4
    assert out["predicted_step_time_s"] > 0 and len(out["spatial_parts"]) == 2
    assert main(["recipe=mesh_tangling_1k", "--world-size", "2", "input_shape=[18,64,64]", "model.widths=[4,4,4,4,4,4]",
                 "--alpha", "1e-5", "--beta", "1e-9"]) == 0
    text = capsys.readouterr().out
    assert "predicted time per mini-batch" in text and "block6.0" in text
    assert main(["recipe=nope", "--world-size", "2"]) == 2


def test_plan_spatial_cli_loaded_sync_reads_the_cached_calibration(tmp_path, monkeypatch, capsys):
    from lightning_hpc.cli.plan_spatial import main
    from lightning_hpc.perfmodel import sync as sync_mod

    monkeypatch.setenv("LIGHTNING_HPC_CACHE", str(tmp_path))
    cached = _sync(4, 2e-3, 3e-3)
    sync_mod._cache_path(4, 1e-3, 40, 5, 64, 4 << 20).write_text(json.dumps(cached.to_dict()))
    monkeypatch.setattr(sync_mod, "measure_sync", lambda *a, **k: pytest.fail("the cached calibration must be used"))
    argv = ["recipe=mesh_tangling_1k", "--world-size", "4", "--batch-size", "1", "input_shape=[18,64,64]",
            "model.widths=[4,4,4,4,4,4]", "--alpha", "1e-5", "--beta", "1e-9", "--json"]
    assert main([*argv, "--loaded-sync"]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert loaded["loaded_sync"] == cached.to_dict() and plain["loaded_sync"] is None
    assert loaded["sync_points"] > 0 and loaded["sync_time_s"] > 0 and plain["sync_time_s"] == 0
    assert loaded["predicted_step_time_s"] > plain["predicted_step_time_s"]


def _plan_in_job(rank, world_size):
    plan = plan_for_model(
        _line_net(), (3, 32, 32), world_size, batch_size=1, alpha_beta=AlphaBeta(1e-6, 1e-10), timer=FlopTimer()
    )
    return {name: str(d) for name, d in plan.distributions.items()}, plan.spatial_parts


def test_plan_inside_a_job_is_made_once_and_shared():
    from lightning_hpc.distributed import run_in_processes

    results = run_in_processes(_plan_in_job, 2, timeout_s=240)
    assert results[0] == results[1]
    assert results[0][1] in ((1, 2), (2, 1))


def test_compute_contention_is_a_slowdown_factor():
    from lightning_hpc.perfmodel import compute_contention

    assert compute_contention(1) == 1.0
    assert compute_contention(2, size=32, channels=4, repeats=2, rounds=1) >= 1.0
    with pytest.raises(ValueError, match="world_size"):
        compute_contention(0)


# ---- loaded synchronisation cost (perfmodel.sync) -----------------------------------------------------------
def _sync(p, allreduce=2e-3, sendrecv=3e-3, **kw):
    return SyncCost(world_size=p, chunk_s=1e-3, allreduce_s=allreduce, sendrecv_s=sendrecv, idle_allreduce_s=0.0,
                    idle_sendrecv_s=0.0, allgather_s=allreduce, **kw)


def test_sync_points_are_counted_from_the_layer_kinds():
    m = AlphaBeta(alpha=1e-5, beta=1e-9)
    stages = build_stages(trace_layers(_line_net(), (1, 3, 32, 32)))  # conv-BN-ReLU, stride-2 conv-ReLU, 1x1 conv
    d = Distribution(1, 2, 2)
    plain = CostModel(m, world_size=4, batch_size=1, timer=FlopTimer())
    loaded = CostModel(m, world_size=4, batch_size=1, timer=FlopTimer(), sync=_sync(4))
    w_sr = 3e-3 - alphabeta.send_recv(64, m)
    w_ar = 2e-3 - alphabeta.allreduce(64, 4, m)
    w_ag = 2e-3 - alphabeta.allgather(4 * 64, 4, m)
    # input conv: forward halo exchange (its input needs no gradient); BN: statistics all-gather forward, allreduce
    # backward; the input extent allreduce of the first stage
    first_p, first_l = plain.stage_cost(stages[0], d), loaded.stage_cost(stages[0], d)
    assert first_l.sync_points == 1 + 2 + 1
    assert first_l.sync_wait == pytest.approx(w_sr + w_ag + 2 * w_ar)
    assert first_l.local == pytest.approx(first_p.local + first_l.sync_wait)
    # its weight-gradient allreduce (tiny) costs at least the measured small allreduce between busy ranks
    assert first_l.allreduce == pytest.approx(max(first_p.allreduce, 2e-3) + max(dict(first_p.allreduces)["1"], 2e-3))
    # inner 3x3 conv: forward and backward exchanges; the 1x1 conv needs none
    assert loaded.stage_cost(stages[1], d).sync_points == 2
    assert loaded.stage_cost(stages[1], d).sync_wait == pytest.approx(2 * w_sr)
    assert loaded.stage_cost(stages[2], d).sync_points == 0
    # sample parallelism has no halo or BN collectives
    assert loaded.stage_cost(stages[0], Distribution(1, 1, 1, replicas=4)).sync_wait == 0.0
    # a shuffle is two all-to-alls (forward, backward), each one synchronisation point
    a, b = Distribution(1, 2, 2), Distribution(1, 4, 1)
    assert loaded.shuffle(1000, a, b) == pytest.approx(plain.shuffle(1000, a, b) + 2 * w_ar)


def test_prediction_grows_by_the_sync_points_times_the_measured_cost():
    model, timer, m = _line_net(), FlopTimer(), AlphaBeta(alpha=1e-5, beta=1e-9)
    want = lambda d: (d.n, d.h, d.w) == (1, 2, 2)  # noqa: E731
    kw = dict(alpha_beta=m, timer=timer, restrict=want, gradient_reduction="single")
    plain = plan_for_model(model, (3, 32, 32), 4, batch_size=1, **kw)
    small = plan_for_model(model, (3, 32, 32), 4, batch_size=1, sync=_sync(4, 1e-3, 1e-3), **kw)
    large = plan_for_model(model, (3, 32, 32), 4, batch_size=1, sync=_sync(4, 3e-3, 3e-3), **kw)
    # 1 + 2 + 1 (first stage) + 2 (second) synchronisation points, plus one gradient allreduce
    assert small.sync_points == large.sync_points == 7 and plain.sync_points == 7
    assert plain.sync_time == 0.0
    # the gradient allreduce is tiny: its alpha-beta cost is below the measured small-allreduce cost, which it pays
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    grad_ab = alphabeta.allreduce(nbytes, 4, m)
    assert small.exposed_allreduce_time == pytest.approx(max(grad_ab, 1e-3))
    # every non-gradient sync point adds the same measured extra: the difference is 6 x 2 ms + the allreduce's 2 ms
    diff = (large.predicted_step_time - large.optimizer_time) - (
        small.predicted_step_time - small.optimizer_time
    )  # optimizer: timed
    assert diff == pytest.approx(6 * 2e-3 + 2e-3, rel=1e-6)
    assert large.sync_time - small.sync_time == pytest.approx(6 * 2e-3, rel=1e-6)


class _SlowFlopTimer(FlopTimer):
    """100x the multiply-add times: backward long enough (tens of ms) to hide millisecond allreduces."""

    def measure(self, module, input_shape, dtype=torch.float32, device="cpu"):
        return {k: 100 * v for k, v in super().measure(module, input_shape, dtype, device).items()}


def test_loaded_gradient_allreduce_and_overlap():
    big = _sync(2, 1e-3, 1e-3, large_bytes=1 << 20, large_allreduce_s=11e-3, large_overlapped_s=5.5e-3)
    assert big.gradient_allreduce(64) == pytest.approx(1e-3)
    assert big.gradient_allreduce(1 << 20) == pytest.approx(11e-3)
    assert big.gradient_allreduce((1 << 20) // 2 + 32) == pytest.approx(6e-3)  # linear between the two points
    assert big.overlap_fraction == pytest.approx(0.5)
    assert _sync(2).overlap_fraction == 1.0  # not measured: section V-B's full overlap
    # overlapped per-layer allreduces: only the measured half of their time hides behind backward
    model, timer, m = _line_net(), _SlowFlopTimer(), AlphaBeta(alpha=1e-9, beta=1e-15)
    kw = dict(alpha_beta=m, timer=timer, restrict=lambda d: d.h == d.w == 1, gradient_reduction="per-layer")
    half = plan_for_model(model, (3, 32, 32), 2, batch_size=2, sync=big, **kw)
    hides_all = dataclasses.replace(big, large_overlapped_s=0.0)
    assert hides_all.overlap_fraction == 1.0
    full = plan_for_model(model, (3, 32, 32), 2, batch_size=2, sync=hides_all, **kw)
    assert (
        half.allreduce_time == pytest.approx(full.allreduce_time) and half.allreduce_time >= 4e-3
    )  # 4 layers, >= 1 ms each
    assert full.exposed_allreduce_time < 0.5 * full.allreduce_time  # backward hides the early ones
    assert half.exposed_allreduce_time == pytest.approx(0.5 * half.allreduce_time)
    # DDP's buckets: this small model fills one bucket, ready only when backward is done: nothing hides it
    ddp = plan_for_model(
        model, (3, 32, 32), 2, batch_size=2, sync=hides_all, **(kw | {"gradient_reduction": "bucketed"})
    )
    assert ddp.exposed_allreduce_time == pytest.approx(ddp.allreduce_time) and ddp.sync_points == 1


def test_ddp_buckets_follow_the_bucket_caps():
    from lightning_hpc.spatial import planner

    big_net = nn.Sequential(
        nn.Conv2d(3, 256, 3, padding=1),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.Conv2d(256, 256, 3, padding=1),
    )
    m = AlphaBeta(alpha=1.0, beta=0.0)  # every allreduce costs 1 s: the count of buckets shows in the time
    plan = plan_for_model(
        big_net,
        (3, 8, 8),
        2,
        batch_size=2,
        alpha_beta=m,
        timer=FlopTimer(),
        restrict=lambda d: d.h == d.w == 1,
        gradient_reduction="bucketed",
    )
    sizes = [4 * sum(p.numel() for p in layer.parameters()) for layer in big_net][::-1]  # backward order
    buckets, acc, cap = 0, 0, planner.DDP_FIRST_BUCKET_BYTES
    for nbytes in sizes:
        acc += nbytes
        if acc >= cap:
            buckets, acc, cap = buckets + 1, 0, planner.DDP_BUCKET_BYTES
    buckets += acc > 0
    assert buckets >= 2 and plan.allreduce_time == pytest.approx(buckets * 1.0)


def test_sync_calibration_must_match_the_world_size():
    with pytest.raises(ValueError, match="calibrate_sync\\(4\\)"):
        plan_for_model(
            _line_net(),
            (3, 16, 16),
            4,
            batch_size=4,
            alpha_beta=AlphaBeta(1e-5, 1e-9),
            timer=FlopTimer(),
            sync=_sync(2),
        )


@pytest.mark.parametrize("conv_cls,shape,parts", [
    (nn.Conv3d, (1, 2, 16, 16, 16), (2, 2, 1)),
    (nn.Conv2d, (1, 2, 16, 16), (1, 2)),
    (nn.Conv1d, (1, 2, 64), (2,)),
])
def test_box_copies_charged_only_where_the_kernel_copies(conv_cls, shape, parts):
    """The in-place tile path copies no box: the planner charges box copies to a convolution of any dimension only
    when its tiles are off the stride grid (here: a stride-2 convolution over an odd extent split in two)."""
    def copies(extent: int) -> float:
        k = len(shape) - 2
        model = nn.Sequential(conv_cls(2, 2, 3, padding=1), conv_cls(2, 2, 3, stride=2, padding=1))
        stages = build_stages(trace_layers(model, (*shape[:2], *(extent,) * k)))
        costs = CostModel(AlphaBeta(alpha=1e-5, beta=1e-9), world_size=math.prod(parts), batch_size=1,
                          timer=FlopTimer())
        d = Distribution(1, *([1] * (3 - k) + list(parts))[1:], d=([1] * (3 - k) + list(parts))[0])
        assert d.parts(k) == parts
        return costs.stage_cost(stages[1], d).copies

    assert copies(shape[-1]) == 0.0  # even extents: every tile starts on the stride grid
    assert copies(shape[-1] + 1) > 0.0  # 17 = 9 + 8: the second tile starts at an odd row of a stride-2 window

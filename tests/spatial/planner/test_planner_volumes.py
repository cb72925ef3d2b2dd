"""The planner in 3-D (and 1-D): halo blocks from the layers' own windows (faces, edges, corners), the split
acceptance of the halo plan, candidate splits of D, H and W, and ``plan-spatial`` on the volume recipe."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_hpc.models.unet import unet
from lightning_hpc.perfmodel import AlphaBeta, alphabeta
from lightning_hpc.spatial.dispatch.windows import halo_elements, layer_windows, split_works
from lightning_hpc.spatial.planner import (
    CostModel,
    Distribution,
    build_stages,
    candidate_distributions,
    plan_for_model,
    trace_layers,
)
from tests.spatial.planner.test_planner import FlopTimer


def test_halo_blocks_of_a_3d_convolution_are_faces_edges_and_corners():
    conv = nn.Conv3d(2, 2, 3, padding=1)
    wins = layer_windows(conv, (1, 2, 16, 16, 16), (1, 2, 16, 16, 16))
    # slabs: an inner slab receives one 16 x 16 face from each side
    assert sorted(halo_elements(wins, (16, 16, 16), (4, 1, 1))) == [256, 256]
    # pencils of 8 x 8 x 16: two faces of 8 x 16 and the edge of 16 between them (no interior pencil at 2 x 2)
    assert sorted(halo_elements(wins, (16, 16, 16), (2, 2, 1))) == [16, 128, 128]
    # cubes of 8^3 at 2 x 2 x 2: three faces, three edges, one corner
    assert sorted(halo_elements(wins, (16, 16, 16), (2, 2, 2))) == [1, 8, 8, 8, 64, 64, 64]
    # a dilated window reaches 2 rows each side: 12 rows in 6 tiles of 2 work, in 8 (tiles of 1 row) they do not
    wide = layer_windows(nn.Conv3d(1, 1, 3, padding=2, dilation=2), (1, 1, 12, 8, 8), (1, 1, 12, 8, 8))
    assert split_works(wide, (12, 8, 8), (6, 1, 1)) and not split_works(wide, (12, 8, 8), (8, 1, 1))


def test_halo_cost_of_a_3d_stage_is_one_send_recv_per_block():
    m = AlphaBeta(alpha=1e-5, beta=1e-9)
    stages = build_stages(trace_layers(nn.Sequential(nn.Conv3d(2, 3, 3, padding=1)), (2, 2, 16, 16, 16)))
    costs = CostModel(m, world_size=4, batch_size=2, timer=FlopTimer())
    sr = lambda elems: alphabeta.send_recv(4 * elems * 2 * 2, m)  # noqa: E731  (n = 2 samples, C = 2)
    assert costs._halo(stages[0].head, Distribution(1, 2, 1, d=2)) == pytest.approx(2 * sr(128) + sr(16))
    assert costs._halo(stages[0].head, Distribution(1, 1, 1, d=4)) == pytest.approx(2 * sr(256))


def test_candidates_split_depth_height_and_width():
    stages = build_stages(trace_layers(nn.Sequential(nn.Conv3d(1, 2, 3, padding=1)), (1, 1, 8, 8, 2)))
    cands = candidate_distributions(stages[0], world_size=4, batch_size=1, ndim=3)
    assert Distribution(1, 2, 1, d=2) in cands and Distribution(1, 1, 1, d=4) in cands
    assert all(d.w <= 2 for d in cands)  # W = 2 cannot hold 4 tiles
    assert all(d.n * d.spatial_size == 4 for d in cands)
    signal = build_stages(trace_layers(nn.Sequential(nn.Conv1d(1, 2, 5, padding=2)), (1, 1, 32)))
    assert {(d.d, d.h, d.w) for d in candidate_distributions(signal[0], 4, 1, ndim=1)} == {(1, 1, 4)}


def test_plan_for_a_3d_unet_splits_the_volume():
    plan = plan_for_model(unet(1, 1, (4, 8)), (1, 16, 16, 16), 4, batch_size=1, alpha_beta=AlphaBeta(1e-5, 1e-9),
                          timer=FlopTimer(), uniform=True)
    assert len(plan.spatial_parts) == 3 and torch.Size(plan.spatial_parts).numel() == 4
    assert plan.halo_time > 0 and plan.predicted_step_time > plan.compute_time


def test_plan_spatial_cli_plans_the_volume_recipe(tmp_path, monkeypatch, capsys):
    from lightning_hpc.cli.plan_spatial import main

    monkeypatch.setenv("LIGHTNING_HPC_CACHE", str(tmp_path))
    argv = ["recipe=volumes_unet3d", "--world-size", "4", "input_shape=[1,16,16,16]", "model.widths=[4,8]",
            "--alpha", "1e-5", "--beta", "1e-9", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["spatial_parts"]) == 3 and out["predicted_step_time_s"] > 0
    for layer in out["layers"]:
        d = layer["distribution"]
        assert d["n"] * d["d"] * d["h"] * d["w"] * d["replicas"] == 4
    # one split for the whole model (what the strategy runs), every layer under it
    assert out["method"] == "uniform" and len({str(layer["distribution"]) for layer in out["layers"]}) == 1
    assert out["memory_per_rank_bytes"]["activations"] < out["memory_per_rank_bytes"]["activations_one_process"]
    assert main(argv[:-1]) == 0
    captured = capsys.readouterr()
    assert "predicted memory per rank: activations" in captured.out
    lines = captured.out.splitlines()
    assert lines[2].startswith("split: ") and "(D x H x W) tiles per sample" in lines[2], lines[:3]
    rows = [line for line in lines[4:] if line.split() and line.split()[0] not in ("spatial", "compute", "predicted")]
    assert rows and all(" D" in row and " H" in row and " W" in row for row in rows), rows  # volumes name D
    assert not any(row.split()[0].startswith(("getattr", "getitem", "add", "cat")) for row in rows), rows
    assert "stage 1/" in captured.err and "tracing the model" in captured.err  # progress while it measures


def test_plan_predicts_the_memory_per_rank_of_its_split():
    """Each layer's output at the rank's tile (here 1 x 1 x 4 of a 16^3 volume: a quarter of each), float32, and
    the parameters with their gradients whole on every rank."""
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv3d(2, 3, 3, padding=1))
    plan = plan_for_model(model, (1, 16, 16, 15), 4, batch_size=2, alpha_beta=AlphaBeta(1e-5, 1e-9),
                          timer=FlopTimer(), uniform=True, restrict=lambda d: (d.n, d.d, d.h, d.w) == (1, 1, 1, 4))
    assert plan.spatial_parts == (1, 1, 4)
    mem = plan.memory_per_rank()
    tile = 2 * 16 * 16 * 4  # two samples, W = 15 in tiles of at most 4
    assert mem == {"activations": 4 * tile * (2 + 2 + 3), "activations_one_process": 4 * 2 * 16 * 16 * 15 * 7,
                   "parameters_and_gradients": 2 * 4 * (2 * 27 + 2 + 3 * 2 * 27 + 3)}
    assert "predicted memory per rank: activations 0.1 MiB (one process: 0.2 MiB, 0.27x)" in plan.table()

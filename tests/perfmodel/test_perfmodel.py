import json
import math

import pytest
import torch

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, alphabeta, calibrate_local, fit_alpha_beta

M = AlphaBeta(alpha=1e-5, beta=1e-9, gamma=0.0)


def test_single_process_collectives_cost_nothing():
    for fn in (alphabeta.broadcast, alphabeta.allreduce, alphabeta.allgather, alphabeta.reduce_scatter, alphabeta.alltoall):
        assert fn(1e6, 1, M) == 0.0


def test_collective_formulas():
    n, p = 8e6, 8
    # Rabenseifner for long messages: 2 log p alpha + 2 (p-1)/p n beta
    assert alphabeta.allreduce(n, p, M) == pytest.approx(2 * 3 * M.alpha + 2 * 7 / 8 * n * M.beta)
    # recursive doubling wins for tiny messages
    assert alphabeta.allreduce(8, p, M) == pytest.approx(3 * (M.alpha + 8 * M.beta))
    assert alphabeta.allgather(n, p, M) == pytest.approx(7 * M.alpha + 7 / 8 * n * M.beta)
    assert alphabeta.send_recv(100, M) == pytest.approx(M.alpha + 100 * M.beta)
    assert alphabeta.alltoall(n, p, M) == pytest.approx(7 * (M.alpha + n / 8 * M.beta))
    # allreduce = reduce-scatter + allgather for long messages (gamma = 0)
    assert alphabeta.allreduce(n, p, M) <= alphabeta.reduce_scatter(n, p, M) + alphabeta.allgather(n, p, M) + 1e-12
    with pytest.raises(ValueError):
        alphabeta.allreduce(1, 0, M)


def test_fit_recovers_alpha_beta():
    sizes = [2.0**k for k in range(4, 22)]
    times = [3e-5 + s * 2e-10 for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha == pytest.approx(3e-5, rel=1e-6) and fit.beta == pytest.approx(2e-10, rel=1e-6)


def test_calibration_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_HPC_CACHE", str(tmp_path))
    fit = calibrate_local(2, use_cache=False)
    assert fit.alpha >= 0 and 0 < fit.beta < 1e-6  # slower than 1 MB/s would mean something is broken
    assert list(tmp_path.glob("alphabeta-*-gloo-2.json"))


def test_layer_timer_measures_and_caches(tmp_path):
    timer = LayerTimer(tmp_path / "t.json", warmup=1, repeats=2)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    t = timer.measure(conv, (2, 4, 16, 16))
    assert t["forward"] > 0 and t["backward"] >= 0
    again = LayerTimer(tmp_path / "t.json").measure(conv, (2, 4, 16, 16))
    assert again == t  # served from the cache file
    assert math.isfinite(t["forward"])


def test_loaded_sync_calibration_is_measured_cached_and_reused(tmp_path, monkeypatch):
    from lightning_hpc.perfmodel import SyncCost, calibrate_sync
    from lightning_hpc.perfmodel import sync as sync_mod

    monkeypatch.setenv("LIGHTNING_HPC_CACHE", str(tmp_path))
    settings = dict(chunk_s=2e-4, iters=3, rounds=1, large_bytes=4096)
    cost = calibrate_sync(2, **settings)
    assert cost.world_size == 2 and cost.chunk_s > 0 and cost.large_bytes == 4096
    # a real collective between two processes takes time
    assert cost.idle_allreduce_s > 0 and cost.idle_sendrecv_s > 0 and cost.idle_allgather_s > 0
    assert min(cost.allreduce_s, cost.allgather_s, cost.sendrecv_s, cost.large_allreduce_s, cost.large_overlapped_s) >= 0
    assert 0.0 <= cost.overlap_fraction <= 1.0
    [entry] = tmp_path.glob("sync-*-gloo-2-*.json")

    def no_measuring(*a, **k):
        raise AssertionError("a cached calibration must not be measured again")

    monkeypatch.setattr(sync_mod, "measure_sync", no_measuring)
    assert calibrate_sync(2, **settings) == cost  # read back from the cache file
    assert SyncCost(**json.loads(entry.read_text())) == cost
    with pytest.raises(AssertionError, match="must not be measured"):
        calibrate_sync(2, **settings, use_cache=False)
    assert calibrate_sync(1) == SyncCost.none(1)  # one process: nothing to synchronise, nothing measured


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(chunk_s=0.0), dict(iters=0), dict(small_bytes=2), dict(large_bytes=32)])
def test_loaded_sync_calibration_rejects_bad_settings(bad):
    from lightning_hpc.perfmodel import calibrate_sync, measure_sync

    args = dict(world_size=2) | bad
    for fn in (calibrate_sync, measure_sync):
        with pytest.raises(ValueError, match="world_size|chunk_s"):
            fn(**args)


def test_loaded_sync_wait_subtracts_the_alpha_beta_cost_of_the_calibration_message():
    from lightning_hpc.perfmodel import SyncCost

    c = SyncCost(world_size=4, chunk_s=1e-3, allreduce_s=5e-3, sendrecv_s=3e-3, idle_allreduce_s=4e-3, idle_sendrecv_s=1e-3)
    assert c.wait("allreduce", M) == pytest.approx(5e-3 - alphabeta.allreduce(64, 4, M))
    assert c.wait("allreduce", M, group=2) == pytest.approx(5e-3 - alphabeta.allreduce(64, 2, M))
    assert c.wait("sendrecv", M) == pytest.approx(3e-3 - alphabeta.send_recv(64, M))
    assert c.wait("allgather", M) == 0.0  # not measured (0 s) is never a negative cost
    assert c.wait("sendrecv", AlphaBeta(alpha=1.0, beta=0.0)) == 0.0  # never negative
    with pytest.raises(ValueError, match="sync kind"):
        c.wait("broadcast", M)

import json
import math

import pytest
import torch

from lightning_hpc.perfmodel import AlphaBeta, LayerTimer, alphabeta, calibrate_local, fit_alpha_beta

M = AlphaBeta(alpha=1e-5, beta=1e-9, gamma=0.0)


def test_single_process_collectives_cost_nothing():
    for fn in (
        alphabeta.broadcast,
        alphabeta.allreduce,
        alphabeta.allgather,
        alphabeta.reduce_scatter,
        alphabeta.alltoall,
    ):
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
    assert (
        min(cost.allreduce_s, cost.allgather_s, cost.sendrecv_s, cost.large_allreduce_s, cost.large_overlapped_s) >= 0
    )
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


@pytest.mark.parametrize(
    "bad", [dict(world_size=0), dict(chunk_s=0.0), dict(iters=0), dict(small_bytes=2), dict(large_bytes=32)]
)
def test_loaded_sync_calibration_rejects_bad_settings(bad):
    from lightning_hpc.perfmodel import calibrate_sync, measure_sync

    args = dict(world_size=2) | bad
    for fn in (calibrate_sync, measure_sync):
        with pytest.raises(ValueError, match="world_size|chunk_s"):
            fn(**args)


def test_loaded_sync_wait_subtracts_the_alpha_beta_cost_of_the_calibration_message():
    from lightning_hpc.perfmodel import SyncCost

    c = SyncCost(
        world_size=4, chunk_s=1e-3, allreduce_s=5e-3, sendrecv_s=3e-3, idle_allreduce_s=4e-3, idle_sendrecv_s=1e-3
    )
    assert c.wait("allreduce", M) == pytest.approx(5e-3 - alphabeta.allreduce(64, 4, M))
    assert c.wait("allreduce", M, group=2) == pytest.approx(5e-3 - alphabeta.allreduce(64, 2, M))
    assert c.wait("sendrecv", M) == pytest.approx(3e-3 - alphabeta.send_recv(64, M))
    assert c.wait("allgather", M) == 0.0  # not measured (0 s) is never a negative cost
    assert c.wait("sendrecv", AlphaBeta(alpha=1.0, beta=0.0)) == 0.0  # never negative
    with pytest.raises(ValueError, match="sync kind"):
        c.wait("broadcast", M)


# -- caches: unreadable files, machine-specific keys, collective cache decisions --
def test_layer_timer_ignores_an_unreadable_cache_and_rewrites_it(tmp_path):
    """A cut-off cache file (a killed job, two writers) costs a re-measurement with a warning, not a crash."""
    path = tmp_path / "t.json"
    path.write_text('{"Conv2d(4, 4, ')
    with pytest.warns(RuntimeWarning, match="unreadable cache file"):
        timer = LayerTimer(path, warmup=1, repeats=1)
    t = timer.measure(torch.nn.Conv2d(4, 4, 3, padding=1), (1, 4, 8, 8))
    assert t["forward"] > 0
    assert len(json.loads(path.read_text())) == 1
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_layer_timer_keys_name_the_machine_and_keep_other_writers_entries(tmp_path):
    """Keys carry host, device model and torch version (a shared home across node types, or an upgrade, must
    not reuse times), and an entry another process wrote meanwhile survives our write."""
    from lightning_hpc.perfmodel.calibrate import machine_fingerprint

    path = tmp_path / "t.json"
    timer = LayerTimer(path, warmup=1, repeats=1)
    path.write_text(json.dumps({"other-process-key": {"forward": 1.0, "backward": 2.0}}))
    timer.measure(torch.nn.Conv2d(2, 2, 1), (1, 2, 4, 4))
    cache = json.loads(path.read_text())
    assert cache["other-process-key"] == {"forward": 1.0, "backward": 2.0}
    [key] = [k for k in cache if k != "other-process-key"]
    assert key.endswith(machine_fingerprint("cpu")) and f"torch={torch.__version__}" in key


def test_cached_measurement_measures_again_for_unreadable_or_foreign_entries(tmp_path):
    from lightning_hpc.perfmodel.calibrate import cached_measurement

    calls = []

    def measure():
        calls.append(1)
        return AlphaBeta(alpha=1.0, beta=2.0)

    path = tmp_path / "ab.json"
    path.write_text("not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert cached_measurement(path, AlphaBeta, measure) == AlphaBeta(alpha=1.0, beta=2.0)
    path.write_text(json.dumps({"alpha": 1.0, "bandwidth": 3.0}))  # another version's fields
    assert cached_measurement(path, AlphaBeta, measure) == AlphaBeta(alpha=1.0, beta=2.0)
    assert cached_measurement(path, AlphaBeta, measure) == AlphaBeta(alpha=1.0, beta=2.0)
    assert len(calls) == 2  # the third call read the file the second one wrote


def _calibrate_with_rank_cache(rank: int, world_size: int, cache_root: str, cached_ranks: tuple[int, ...]) -> dict:
    """Each rank has its own cache directory (ranks on different hosts); only ``cached_ranks`` hold an entry."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from lightning_hpc.perfmodel.calibrate import _cache_key, calibrate

    os.environ["LIGHTNING_HPC_CACHE"] = str(Path(cache_root) / f"rank{rank}")
    if rank in cached_ranks:
        _cache_key(dist.get_backend(), world_size).write_text(json.dumps({"alpha": 1e-3 * (rank + 1), "beta": 7e-9}))
    return calibrate().to_dict()


@pytest.mark.parametrize("cached_ranks", [(0,), (1,)], ids=["only_rank0_cached", "only_rank1_cached"])
def test_calibrate_lets_rank0_decide_between_cache_and_measuring(tmp_path, cached_ranks):
    """Ranks whose caches disagree (different hosts) must not take different paths: that hung in the ping-pong.
    Every rank gets rank 0's answer: its cached entry, or one shared measurement."""
    from lightning_hpc.distributed import run_in_processes

    results = run_in_processes(
        _calibrate_with_rank_cache, 2, str(tmp_path), cached_ranks, timeout_s=120, collective_timeout_s=20
    )
    assert results[0] == results[1]
    if cached_ranks == (0,):
        assert (results[0]["alpha"], results[0]["beta"]) == (1e-3, 7e-9)
    else:  # rank 1's cache is ignored: measured, and written to rank 0's cache
        assert results[0]["beta"] != 7e-9 and 0 < results[0]["beta"] < 1e-6
        assert list((tmp_path / "rank0").glob("alphabeta-*-gloo-2.json"))

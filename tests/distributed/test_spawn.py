import time

import pytest
import torch
import torch.distributed as dist

from lightning_hpc.distributed import DistributedRunError, run_in_processes


def _allreduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t)


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _hang_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_ordered_by_rank(world_size):
    out = run_in_processes(_allreduce_rank, world_size)
    assert out == [float(sum(range(world_size)))] * world_size


def test_rank_error_is_reported_with_traceback():
    with pytest.raises(DistributedRunError, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_in_processes(_raise_on_rank1, 2, timeout_s=60, collective_timeout_s=10)


@pytest.mark.timeout(60)  # a hang guard: the harness itself must not block past its deadline
def test_hang_fails_instead_of_blocking():
    with pytest.raises(DistributedRunError, match="did not finish"):
        run_in_processes(_hang_on_rank0, 2, timeout_s=2, collective_timeout_s=600)


def _return_tensors(rank: int, world_size: int) -> dict:
    return {"rank": torch.full((64, 64), float(rank)), "list": [torch.arange(3) * rank]}


def test_tensor_results_survive_the_worker_exiting():
    for _ in range(2):
        out = run_in_processes(_return_tensors, 2)
        assert [float(o["rank"].sum()) for o in out] == [0.0, 64.0 * 64]
        assert out[1]["list"][0].tolist() == [0, 1, 2]


def test_a_port_taken_before_rank_0_listens_is_replaced(monkeypatch):
    """Another program takes the free port between find_free_port() and rank 0's listen (seen when test suites
    share a machine): the run starts again on a new port instead of failing."""
    import socket

    from lightning_hpc.distributed import spawn

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = spawn.find_free_port
        monkeypatch.setattr(spawn, "find_free_port", lambda: ports.pop() if ports else real())
        assert run_in_processes(_allreduce_rank, 2) == [1.0, 1.0]
        assert not ports, "the taken port was never tried: the test proves nothing"


def _read_env(rank: int, world_size: int) -> tuple[str | None, str | None]:
    import os

    return os.environ.get("LIGHTNING_HPC_PROBE_SET"), os.environ.get("LIGHTNING_HPC_PROBE_UNSET")


def test_ranks_see_the_callers_environment_of_now(monkeypatch):
    """Ranks are forked from a server started by an earlier run: they must see the environment of this call
    (a variable set since, one removed since), not the one the server started with."""
    monkeypatch.setenv("LIGHTNING_HPC_PROBE_UNSET", "stale")
    run_in_processes(_allreduce_rank, 2)  # the server exists from here on, with the stale variable
    monkeypatch.setenv("LIGHTNING_HPC_PROBE_SET", "now")
    monkeypatch.delenv("LIGHTNING_HPC_PROBE_UNSET")
    assert run_in_processes(_read_env, 2) == [("now", None)] * 2


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("LIGHTNING_HPC_START_METHOD", "teleport")
    with pytest.raises(ValueError, match="teleport"):
        run_in_processes(_allreduce_rank, 2)

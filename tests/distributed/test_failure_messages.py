"""A failing rank's message reaches every peer before its process ends (``FailureMessages``): also when the
failing rank is rank 0, which hosts the store, and its peers learn of the failure only when its exit closes
their gloo connections; ranks that fail together do not wait for one another."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.failure import FailureMessages


def _messages(key: str) -> FailureMessages:
    failures = FailureMessages(dist.distributed_c10d._get_default_store(), key, dist.get_rank(), dist.get_world_size())
    failures.start()
    return failures


def _rank0_fails(rank: int, world: int) -> dict:
    failures = _messages("test/rank0")
    if rank == 0:
        took = failures.publish("rank 0: RuntimeError: bad sample")
        failures.stop()
        return {"took": took}  # this process ends: its connections close
    try:  # waits on rank 0, which never sends: released by rank 0's exit (gloo's abort would close nothing)
        dist.recv(torch.zeros(1), 0)
        error = None
    except RuntimeError as e:
        error = str(e)
    message = failures.received()
    failures.stop()
    return {"error": error, "message": message}


def test_rank0_failure_reaches_every_peer_before_its_store_goes():
    # the collectives' timeout is longer than the run's deadline: a peer released by its timeout fails the run
    results = run_in_processes(_rank0_fails, 3, timeout_s=120, collective_timeout_s=900)
    assert results[0]["took"], results[0]  # every peer took the message before rank 0's acknowledgement timeout
    for res in results[1:]:
        assert res["error"] is not None, res  # released by rank 0's exit, not by a message
        assert res["message"] == "rank 0: RuntimeError: bad sample", res


def _all_fail(rank: int, world: int) -> dict:
    failures = _messages("test/all")
    took = failures.publish(f"rank {rank}: ValueError: refused")
    message = failures.received()
    failures.stop()
    quiet = _messages("test/quiet")  # a run without failures: stop ends the listener, nothing received
    quiet.stop()
    return {"took": took, "message": message, "quiet": quiet.received(timeout=0.0)}


def test_ranks_failing_together_do_not_wait_for_each_other():
    results = run_in_processes(_all_fail, 2, timeout_s=120, collective_timeout_s=60)
    for rank, res in enumerate(results):
        assert res["took"], res  # each took the other's message: neither waited out the acknowledgement timeout
        assert res["message"] == f"rank {1 - rank}: ValueError: refused", res
        assert res["quiet"] is None, res

"""Run a function in N local processes joined by a torch.distributed process group.

Used by the test-suite and the benchmarks of every technique: each process initialises a process
group (gloo by default, so it runs on CPU), calls ``fn(rank, world_size, *args)`` and sends back its
return value.  The parent enforces a wall-clock deadline, so a hung collective fails the caller with a
message naming the ranks that did not finish instead of blocking CI forever.

Ranks are forked from a ``forkserver``: one server process per parent imports torch (and whatever
:func:`preload` adds, the test-suite adds Lightning) once, and every rank of every later run is a fresh fork of
it.  A ``spawn`` start re-imports torch and Lightning in every rank, seconds each on a small machine, and the
test-suite starts hundreds of ranks.  The server is single-threaded apart from the BLAS pool, which handles
fork itself (the same pattern as a DataLoader's forked workers), and it never runs a torch op, so no OpenMP or
CUDA state is forked.  Each rank still starts empty of any earlier run's state and receives the caller's
current environment (the server's own is from when it started).  ``LIGHTNING_HPC_START_METHOD=spawn`` goes back
to fresh interpreters.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

__all__ = ["find_free_port", "run_in_processes", "DistributedRunError", "preload"]

#: modules the forkserver imports before it forks the first rank; see :func:`preload`
_PRELOAD: list[str] = ["torch", "torch.distributed", "lightning_hpc.distributed.spawn"]


class DistributedRunError(RuntimeError):
    """A rank raised, died, or did not finish before the deadline."""


def find_free_port() -> int:
    """Return a TCP port on localhost that is free right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` once, so no rank pays for them (the test-suite preloads Lightning).

    Takes effect when the server starts, at the first :func:`run_in_processes` of this process; a module that
    fails to import is skipped there and imported by each rank as before.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _start_method() -> str:
    method = os.environ.get("LIGHTNING_HPC_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        raise ValueError(f"LIGHTNING_HPC_START_METHOD={method!r}: this platform offers {mp.get_all_start_methods()}")
    return method


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    collective_timeout_s: float,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue[tuple[int, bool, Any]],
) -> None:
    import torch
    import torch.distributed as dist

    # the caller's environment as it is now: a forked rank would otherwise see the server's, from its start
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Two cores are shared by all ranks: one intra-op thread per rank avoids oversubscription.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value: the queue's own (shared-memory) tensor transfer would hand the
        # parent a handle to memory that disappears when this process exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks and return their results.

    ``fn`` and ``args`` must be picklable (a module-level function).  Results are returned ordered by
    rank.  Raises :class:`DistributedRunError` with the failing rank's traceback if any rank raises,
    dies, or if the whole run exceeds ``timeout_s``; surviving ranks are killed so nothing lingers.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, env)
        except _PortTaken:
            # the free port was taken by another program between find_free_port() and rank 0's listen (nothing of
            # fn ran yet): a new port, a new start
            if attempt == _PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


class _PortTaken(DistributedRunError):
    """Rank 0 could not listen on the chosen MASTER_PORT (taken meanwhile)."""


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    backend: str,
    timeout_s: float,
    collective_timeout_s: float,
    env: dict[str, str] | None,
) -> list[Any]:
    method = _start_method()
    ctx: Any = mp.get_context(method)  # a context of either start method (typeshed types it by a literal name)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    results = ctx.Queue()
    port = find_free_port()
    rank_env = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, collective_timeout_s, rank_env, fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    finished = False
    try:
        while len(out) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise DistributedRunError(
                    f"{fn.__name__}: ranks {missing} did not finish within {timeout_s:.0f}s "
                    f"(world_size={world_size}); a collective is probably waiting on a rank that never joins"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive() and p.exitcode != 0]
                if dead:
                    # Give a rank that died with a Python error a moment to deliver its traceback.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedRunError(
                            f"{fn.__name__}: ranks died without a result, exit codes {codes}"
                        ) from None
                else:
                    continue
            if not ok:
                error = _PortTaken if "EADDRINUSE" in value and "init_process_group" in value else DistributedRunError
                raise error(f"{fn.__name__}: rank {rank} of {world_size} failed:\n{value}")
            out[rank] = pickle.loads(value)
        finished = True
    finally:
        for p in procs:
            # every rank delivered its result: it is leaving, give it the time to; on an error the others are
            # waiting in a collective for a rank that will never join (or past the deadline): killed at once
            if finished:
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]

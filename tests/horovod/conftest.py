"""The Horovod cases of the default tier in two ``horovodrun`` launches, one per world size (``hvd_launch.TWO_RANKS``,
``hvd_launch.FOUR_RANKS``, run by workers/run_cases.py).

Each launch starts once per pytest run, when a test first needs it; every test reads its own case's result files, so
each check stays its own test.  A launch that exits with an error fails every test that reads it, with its output.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hvd_launch import FOUR_RANKS, TWO_RANKS, SharedLaunch, user_threads, worker_env

from lightning_hpc.horovod.communicator import horovod_available


def _skip_without_horovod() -> None:
    if not horovod_available():
        pytest.skip("Horovod is not importable with this torch: build it with scripts/install-horovod.sh")


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> Iterator[SharedLaunch]:
    _skip_without_horovod()
    env = worker_env()
    env.pop("OMP_NUM_THREADS")  # what the strategy does without it is checked (test_horovod_threads.py)
    launch = SharedLaunch(2, tmp_path_factory.mktemp("horovod_np2"), TWO_RANKS, env, timeout_s=540)
    yield launch
    launch.finish()  # no launch outlives the pytest run


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory) -> Iterator[SharedLaunch]:
    _skip_without_horovod()
    env = worker_env()
    env["OMP_NUM_THREADS"] = str(user_threads())
    launch = SharedLaunch(4, tmp_path_factory.mktemp("horovod_np4"), FOUR_RANKS, env, timeout_s=540)
    yield launch
    launch.finish()

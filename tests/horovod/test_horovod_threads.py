"""Under horovodrun, each rank gets its share of the node's CPUs as torch threads (as DDP does), unless the user
set OMP_NUM_THREADS.  Before: every rank kept torch's default (all cores); with 2 ranks on 2 cores a step took
0.18-0.29 s instead of 0.063-0.072 s (docs/horovod.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hvd_launch import REPO, WORKERS, horovodrun_command, requires_horovod, worker_env

pytestmark = [pytest.mark.horovod, requires_horovod]


def _threads(env_threads: str | None) -> list[tuple[int, int, int]]:
    env = worker_env()
    env.pop("OMP_NUM_THREADS")
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads
    cmd = [*horovodrun_command(2), sys.executable, str(WORKERS / "threads_case.py")]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    found = re.findall(r"THREADS rank=\d threads=(\d+) cpus=(\d+) local=(\d+)", out.stdout)
    assert len(found) == 2, out.stdout[-4000:]
    return [tuple(int(v) for v in f) for f in found]


def test_each_rank_gets_its_share_of_the_cpus():
    for threads, cpus, local in _threads(None):
        assert threads == max(1, cpus // local), (threads, cpus, local)


def test_omp_num_threads_set_by_the_user_wins():
    for threads, _, _ in _threads("2"):
        assert threads == 2

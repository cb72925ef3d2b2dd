"""Under horovodrun, each rank gets its share of the node's CPUs as torch threads (as DDP does), unless the user
set OMP_NUM_THREADS.  Before: every rank kept torch's default (all cores); with 2 ranks on 2 cores a step took
0.18-0.29 s instead of 0.063-0.072 s (docs/horovod.md).

Both are the first fit of a shared launch (conftest.py): the 2-process launch runs without OMP_NUM_THREADS, the
4-process one with a value that is not the share (``hvd_launch.user_threads``)."""

from __future__ import annotations

import pytest
from hvd_launch import FOUR_RANKS, TWO_RANKS, requires_horovod, user_threads

pytestmark = [pytest.mark.horovod, requires_horovod]


def test_each_rank_gets_its_share_of_the_cpus(two_ranks):
    # the launch's first fit, and nothing chose the threads before the strategy did
    assert TWO_RANKS[0][0] == "digits_vs_ddp"
    assert two_ranks.omp_at_start("digits_vs_ddp") == [None, None]
    for rank in two_ranks.ranks("digits_vs_ddp"):
        threads, cpus, local = (rank["threads"][k] for k in ("threads", "cpus", "local"))
        assert local == 2 and threads == max(1, cpus // local), (threads, cpus, local)


def test_omp_num_threads_set_by_the_user_wins(four_ranks):
    chosen = user_threads()
    assert FOUR_RANKS[0][0] == "threads_user"  # the launch's first fit
    assert four_ranks.omp_at_start("threads_user") == [str(chosen)] * 4
    for rank in four_ranks.ranks("threads_user"):
        assert rank["local"] == 4 and chosen != max(1, rank["cpus"] // 4)
        assert rank["threads"] == chosen

"""Section 4(b): the next sub-batch's exchange overlaps the head's computation on the current one.

Checked on the order of operations of one training step (2 gloo ranks): the exchanges run on their own process
group (collectives of one group execute in issue order, so sharing the head's group would make the head's
between-layer collectives wait for every prefetched exchange), all forward exchanges are issued before the head's
first collective and sub-batch 1 is waited for only after the head has worked on sub-batch 0; in the backward the
reverse exchanges are issued asynchronously and collected only after the remaining head backward work.  The time
this saves is measured by ``bench/hybrid_fc.py --overlap``.
"""

from __future__ import annotations

import pytest
from hybrid_workers import overlap_events

from lightning_hpc.distributed import run_in_processes

K = 2
REVERSE = {"b": "reduce", "c": "reduce_scatter"}
FORWARD = {"b": "broadcast", "c": "all_gather"}


@pytest.mark.parametrize("scheme", ["b", "c"])
def test_exchange_overlaps_head_computation(scheme):
    on, off = [run_in_processes(overlap_events, K, scheme, flag, timeout_s=120) for flag in (True, False)]
    for r in on:
        ev = r["events"]
        assert r["separate_groups"], "the exchange must not share the head's process group"
        first_head = next(i for i, e in enumerate(ev) if e[0] == "head")
        # forward: all K exchanges issued up front, before the head's first collective ...
        assert [e for e in ev[:first_head] if e[0] == "x"] == [("x", FORWARD[scheme])] * K, ev
        # ... and sub-batch 1 waited for only after the head's collectives on sub-batch 0 were issued
        assert ev.index(("wait", 1)) > first_head, ev
        # backward: the first reverse exchange is followed by head work before anything is collected
        first_rev = ev.index(("x", REVERSE[scheme]))
        collect = ev.index(("collect", "collect_reverse"))
        assert any(e[0] == "head" for e in ev[first_rev:collect]), ev
        assert [e for e in ev[first_rev:] if e[0] == "x"] == [("x", REVERSE[scheme])] * K, ev
    for r in off:  # the control: without overlap sub-batch 1 is only fetched after sub-batch 0's head work
        ev = r["events"]
        assert not r["separate_groups"]
        fetch_1 = [i for i, e in enumerate(ev) if e == ("head", FORWARD[scheme])][1]
        assert any(e[0] == "head" and e[1] != FORWARD[scheme] for e in ev[:fetch_1]), ev

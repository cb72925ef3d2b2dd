"""A node that fails mid-training ends the job on the other node within the strategy's timeout.

The job is started with examples/cluster/torchrun_c10d.sh on both simulated nodes and a short collective
timeout; once node 0 trains, node 1 fails: its link goes down first (node 0's ranks hear nothing more, as
after a power loss, rather than a closed connection), then all its processes are killed.  Node 0's ranks must
fail their next collective after the timeout and torchrun on node 0 must exit non-zero, not hang.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.cluster.launch import EXAMPLES, next_port, node_env
from tests.cluster.test_multinode import STRATEGIES

#: collective timeout given to the strategy (seconds)
TIMEOUT_S = 20
#: allowed on top of the timeout: the exception reaching Lightning, the ranks exiting, torchrun noticing it
MARGIN_S = 60

LONG = [
    "trainer.max_epochs=1000", "trainer.enable_progress_bar=false", "logger=none",
    "~callbacks.lr_monitor", "~callbacks.checkpoint", "~callbacks.last",
    f"strategy.timeout.seconds={TIMEOUT_S}",
]
EXTRA = {"layered_sgd": [f"strategy.layered_timeout_s={TIMEOUT_S}"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("failure")


def _wait_for_text(path, text: str, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a node exited before training started:\n{path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"training did not start within {timeout:.0f}s:\n{path.read_text(errors='replace')[-4000:]}")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_failed_node_ends_the_job_on_the_other_node_within_the_timeout(strategy, sim_nodes, workdir):
    job = f"fail-{strategy}"
    port = next_port()
    args = [*STRATEGIES[strategy], *LONG, *EXTRA.get(strategy, [])]
    procs, logs = [], []
    try:
        for node in sim_nodes:
            log = workdir / f"{job}.{node.hostname}.log"
            env = node_env(HEAD=sim_nodes[0].hostname, PORT=str(port), JOB_ID=job, NNODES="2", NPROC="2")
            procs.append(node.popen(["bash", str(EXAMPLES / "torchrun_c10d.sh"), *args], env=env, cwd=workdir,
                                    stdout=open(log, "w")))
            logs.append(log)
        # Rank 0 prints the model summary when fit starts; a few seconds later every rank is in the loop.
        _wait_for_text(logs[0], "Trainable params", procs, 180)
        time.sleep(5)
        assert procs[0].poll() is None and procs[1].poll() is None, "both nodes must still train"
        t0 = time.monotonic()
        sim_nodes[1].fail()
        try:
            rc = procs[0].wait(timeout=TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node 0 still runs {TIMEOUT_S + MARGIN_S}s after node 1 failed (timeout {TIMEOUT_S}s):\n"
                f"{logs[0].read_text(errors='replace')[-4000:]}") from None
        elapsed = time.monotonic() - t0
        print(f"{strategy}: node 0 exited (rc {rc}) {elapsed:.1f}s after node 1 failed (timeout {TIMEOUT_S}s)")
        assert rc != 0, "the job must fail, not report success"
        # Every job process of node 0 is gone (no rank left hanging in a collective).
        deadline = time.monotonic() + 15
        while sim_nodes[0].job_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sim_nodes[0].job_pids() == [], "node 0 kept processes after its torchrun exited"
    finally:
        sim_nodes[1].kill_jobs()
        sim_nodes[0].kill_jobs()
        sim_nodes[1].set_link(True)

"""SIGTERM mid-epoch ends every rank under layered_sgd, hybrid_fc and multigrid (2 gloo CPU processes that
Lightning's own launcher starts, as a user's script): sent to every rank (the process group, as ``scancel``, a
preempted job or ``timeout`` do), to rank 0 only and to rank 1 only.

Before, Lightning's SIGTERM handler ran a broadcast from inside the signal handler, in the middle of whatever
collectives the rank was running; under these strategies the ranks' collectives then no longer matched and every
rank waited until the process group's timeout (multigrid: both ranks alive 60 s after the signal in 4 of 6 tries,
to every rank, to rank 0 and to rank 1 alike: a race).  The bound on the processes' end is a hang detector (they
end in seconds), not a timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "sigterm_script.py"
#: a run that has not ended this long after the signal hangs
END_BOUND_S = 60.0
START_BOUND_S = 300.0
#: steps per rank in the script's epoch: the run must end before them (ended by the signal, not by the data)
EPOCH_STEPS = 4096 // 8 // 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _steps(out: Path) -> list[int]:
    return [int((out / f"step{r}").read_text() or 0) if (out / f"step{r}").exists() else -1 for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["every rank", "rank 0", "rank 1"])
@pytest.mark.parametrize("strategy", ["layered_sgd", "hybrid_fc", "multigrid"])
def test_sigterm_mid_epoch_ends_every_rank(tmp_path, strategy, target):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([sys.executable, str(SCRIPT), strategy, str(tmp_path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    pids: list[int] = []
    try:
        start = time.monotonic()
        while min(_steps(tmp_path)) < 2:
            assert proc.poll() is None, f"ended before the signal:\n{(tmp_path / 'log').read_text()[-4000:]}"
            assert time.monotonic() - start < START_BOUND_S, "the run did not reach step 2"
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        if target == "every rank":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(pids[int(target[-1])], signal.SIGTERM)
        signalled = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - signalled < END_BOUND_S:
            proc.poll()
            time.sleep(0.2)
        hung = [r for r, pid in enumerate(pids) if _alive(pid)]
        if hung:  # the ranks' stacks, for the report
            for r in hung:
                os.kill(pids[r], signal.SIGUSR2)
            time.sleep(2)
        assert not hung, (f"ranks {hung} still alive {END_BOUND_S:.0f} s after SIGTERM to {target}:\n"
                          f"{(tmp_path / 'log').read_text()[-12000:]}")
        assert max(_steps(tmp_path)) < EPOCH_STEPS - 1, "the run ended with its data, not with the signal"
    finally:
        for pid in pids:  # nothing of the run outlives the test (rank 1 outlives a killed rank 0's group)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def test_the_sigterm_handler_records_the_signal_without_a_collective(monkeypatch):
    """The handler a strategy installs records the signal (the training loop ends at the batch boundary) and runs
    no collective: in a live process group, a broadcast from it would be answered by another collective."""
    import torch.distributed as dist

    from lightning_hpc.distributed.sigterm import sigterm_without_collective
    from tests import fit_harness

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective from inside the SIGTERM handler")

    monkeypatch.setattr(dist, "broadcast", no_collective)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    trainer = fit_harness.trainer()
    monkeypatch.setattr(type(trainer), "world_size", property(lambda self: 2))
    sigterm_without_collective(trainer)
    sigterm_without_collective(trainer)  # a second setup keeps it
    connector = trainer._signal_connector
    previous = signal.getsignal(signal.SIGTERM)
    try:
        connector.register_signal_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        assert trainer.received_sigterm
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, previous)

"""The exit handler of lightning_hpc.distributed.exit: destroys a live gloo group at a clean exit, never after a crash.

Each case runs a fresh interpreter that initialises a one-process gloo group, runs asynchronous collectives,
and registers a probe ``atexit`` handler *before* creating a lightning_hpc communicator (which installs the
library's handler, as every strategy does), so the probe runs after the library's handler (last-in first-out)
and reports whether the group was still initialised at that point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    import torch
    import torch.distributed as dist

    def probe():
        print("INITIALISED_AT_EXIT", dist.is_initialized(), flush=True)

    atexit.register(probe)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from lightning_hpc.distributed.comm import get_communicator

    comm = get_communicator("torch")  # installs the library's exit handler, after the probe
    t = torch.ones(8)
    comm.allreduce(t, op="mean", async_op=True).wait()
    if sys.argv[2] == "crash":
        raise RuntimeError("simulated failure after the collectives")
    """
)


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_clean_exit_destroys_the_process_group(tmp_path):
    proc = _run(tmp_path, "clean")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "INITIALISED_AT_EXIT False" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_exit_on_uncaught_exception_leaves_the_group_alone(tmp_path):
    proc = _run(tmp_path, "crash")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "simulated failure" in proc.stderr
    assert "INITIALISED_AT_EXIT True" in proc.stdout, proc.stdout + proc.stderr[-2000:]

"""Launch utilities of the cluster tier: the examples folder, fresh ports, the environment of a launched job."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "cluster"

_ports = itertools.count(29400 + os.getpid() % 500 * 2)


def next_port() -> int:
    return next(_ports)


def node_env(**extra: str) -> dict[str, str]:
    """The environment of a launched job: this interpreter's bin folder first on PATH (torchrun, python),
    no launcher variables of an enclosing job, one thread per process (4 ranks share the machine's cores)."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GROUP_RANK", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "PMI_", "OMPI_"))}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hpc.distributed import spawn

REPO = Path(__file__).resolve().parent.parent

# Most rank functions of the suite train through Lightning: the forkserver imports it once instead of every rank.
spawn.preload("lightning.pytorch")

#: variables a launcher sets for its ranks; a child launched by a test must never inherit stale ones
LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def isolated_distributed_state():
    """In-process Trainer tests leave Lightning's launcher variables (MASTER_PORT, LOCAL_RANK, ...) and a
    process group behind; later tests that start `lightning-hpc` or torchrun-like children would inherit them
    (a child then binds the same port, or believes it was launched externally).  Restore both after each test."""
    before = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


def run_cli(args, cwd, timeout=600, check=True, env=None):
    """Run ``python -m lightning_hpc <args>`` in ``cwd``; returns the CompletedProcess (stdout+stderr merged)."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    full_env = {**base, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hpc", *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"lightning-hpc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def run_dirs(cwd: Path, recipe: str) -> list[Path]:
    return sorted((cwd / "outputs" / recipe).iterdir())


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture
def cli(tmp_path):
    def _run(*args, **kwargs):
        return run_cli(list(args), tmp_path, **kwargs)

    _run.cwd = tmp_path
    return _run


@pytest.fixture
def cli_in_process(tmp_path, monkeypatch, capfd):
    """As :func:`cli`, but the command runs in this process (``lightning_hpc.cli.main.main``), which has imported
    Lightning already: rank 0 of a multi-process recipe runs here, and Lightning starts the other ranks as
    ``python -m lightning_hpc train`` children, as under the installed command.  Returns a CompletedProcess
    (stdout+stderr, this process's and the children's, merged)."""
    from lightning_hpc.cli.main import main

    monkeypatch.chdir(tmp_path)
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def _run(*args, check=True):
        capfd.readouterr()  # what earlier runs in this test printed is theirs
        handlers, level = logging.root.handlers[:], logging.root.level
        try:
            code = main(list(args))
        except SystemExit as e:  # Hydra reports a job's error and exits
            code = e.code if isinstance(e.code, int) else 1
        finally:
            # Hydra's job logging adds handlers on the capture streams of this test: later tests must not log there
            for handler in set(logging.root.handlers) - set(handlers):
                handler.close()
            logging.root.handlers[:] = handlers
            logging.root.setLevel(level)
        out, err = capfd.readouterr()
        proc = subprocess.CompletedProcess(["lightning-hpc", *args], code, out + err)
        if check and code != 0:
            raise AssertionError(f"lightning-hpc {' '.join(args)} failed ({code}):\n{proc.stdout[-6000:]}")
        return proc

    _run.cwd = tmp_path
    return _run

"""Fixtures of the cluster tier: two simulated nodes, a local SLURM on them, and a launcher for the examples.

Every test here carries the ``cluster`` marker.  Where the tier cannot run (not root, no network namespaces,
no SLURM binaries) its tests are skipped with the reason printed in the summary (pytest ``-ra``) and on the
terminal at the start of the tier.  ``LIGHTNING_HPC_SKIP_CLUSTER=1`` skips it on purpose (same report), or
deselect it with ``-m "not cluster"``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from lightning_hpc.testing import simulated_nodes as netns
from tests.cluster import slurm, ssh
from tests.cluster.launch import node_env


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent == here:
            item.add_marker(pytest.mark.cluster)


def _announce(request, reason: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    line = f"cluster tier skipped: {reason}"
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line, yellow=True)
    else:
        print(line, file=sys.stderr)


def _skip_if(request, reason: str | None) -> None:
    """Skip the test, announcing the reason, when ``reason`` is set."""
    if reason:
        _announce(request, reason)
        pytest.skip(reason)


def _interrupt_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def tier_unavailable() -> str | None:
    """Why the simulated nodes cannot be used here, or None."""
    if os.environ.get("LIGHTNING_HPC_SKIP_CLUSTER", "") not in ("", "0"):
        return "LIGHTNING_HPC_SKIP_CLUSTER is set"
    return netns.unavailable_reason()


@pytest.fixture(scope="session")
def sim_nodes(request):
    _skip_if(request, tier_unavailable())
    # A CI job cancelled with SIGTERM still runs the teardown (daemons stopped, namespaces deleted).
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    with netns.SimNodes(2) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def local_slurm(request, sim_nodes, tmp_path_factory):
    _skip_if(request, slurm.unavailable_reason())
    with slurm.LocalSlurm(sim_nodes, tmp_path_factory.mktemp("slurm"), env=node_env()) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ssh_between_nodes(request, sim_nodes, tmp_path_factory):
    """sshd on every simulated node and an ``ssh`` that reaches them (``horovodrun``'s remote start)."""
    _skip_if(request, ssh.unavailable_reason())
    with ssh.SshOnNodes(sim_nodes, tmp_path_factory.mktemp("ssh")) as s:
        yield s

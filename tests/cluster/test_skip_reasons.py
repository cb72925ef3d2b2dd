"""Where the cluster tier cannot run, it says why (these checks run everywhere, without root)."""

import shutil
from unittest import mock

from lightning_hpc.testing import simulated_nodes as netns
from tests.cluster import slurm


def test_not_root_is_named():
    with mock.patch("os.geteuid", return_value=1000):
        assert "not root" in netns.unavailable_reason()


def test_missing_tools_are_named():
    with mock.patch.object(shutil, "which", return_value=None), mock.patch("pathlib.Path.exists", return_value=False):
        reason = slurm.unavailable_reason()
    assert "slurmctld" in reason and "munged" in reason and "apt-get install" in reason

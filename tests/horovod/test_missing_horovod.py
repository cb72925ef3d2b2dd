"""Without Horovod: importing lightning_hpc works, asking for Horovod says how to install it.

Horovod's absence is simulated (``sys.modules["horovod"] = None`` makes ``import horovod.torch`` fail), so
these tests run whether or not Horovod is installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hvd_launch import REPO, worker_env

from lightning_hpc.horovod.communicator import HorovodUnavailableError, import_horovod


@pytest.fixture
def no_horovod(monkeypatch):
    for name in ("horovod", "horovod.torch"):
        monkeypatch.setitem(sys.modules, name, None)


def test_backend_error_says_how_to_install(no_horovod):
    from lightning_hpc.distributed import get_communicator

    with pytest.raises(HorovodUnavailableError, match="scripts/install-horovod.sh"):
        import_horovod()
    with pytest.raises(ImportError, match="scripts/install-horovod.sh"):
        get_communicator("horovod")


def test_strategy_error_says_how_to_install(no_horovod):
    from lightning_hpc import HorovodStrategy
    from tests import fit_harness

    with pytest.raises(ImportError, match="scripts/install-horovod.sh"):
        HorovodStrategy()
    with pytest.raises(ImportError, match="scripts/install-horovod.sh"):
        fit_harness.trainer(strategy="horovod")


def test_import_and_registration_never_import_horovod():
    code = (
        "import sys; import lightning_hpc\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'horovod' in StrategyRegistry, 'strategy name not registered'\n"
        "assert 'horovod' not in sys.modules, 'import lightning_hpc imported horovod'\n"
        "sys.modules['horovod'] = sys.modules['horovod.torch'] = None\n"
        "from lightning_hpc import HorovodStrategy\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]

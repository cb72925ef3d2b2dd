"""The plain-torch cores import with Lightning blocked, quickly, and without side effects.

Inside a technique folder only the adapter files (``strategy.py``, ``callback.py``, ``precision.py``,
``environment.py``) may import Lightning; ``modules/``, ``data/`` (LightningDataModules) and ``cli/`` are
Lightning code by nature.  Every other module is a core: this test imports each one in a fresh interpreter in
which ``import lightning`` raises, checks it takes well under a second once torch is loaded, and that importing it
registered no strategy name and installed no exit handler.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hpc

ADAPTER_FILES = {"strategy", "callback", "precision", "environment"}
LIGHTNING_PACKAGES = {"modules", "data", "cli"}
LIGHTNING_MODULES = {"lightning_hpc.__main__", "lightning_hpc.registry"}


def core_modules() -> list[str]:
    root = Path(lightning_hpc.__file__).parent
    names = []
    for info in pkgutil.walk_packages([str(root)], prefix="lightning_hpc."):
        parts = info.name.split(".")
        if parts[1] in LIGHTNING_PACKAGES or parts[-1] in ADAPTER_FILES or info.name in LIGHTNING_MODULES:
            continue
        names.append(info.name)
    return sorted(names)


PROBE = r"""
import atexit, importlib, importlib.abc, json, sys, time

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"):
            raise ImportError(f"blocked for this test: {name}")
        return None

sys.meta_path.insert(0, Block())
import torch  # noqa: F401  (torch's own import time is not ours)
registered = []
atexit_register = atexit.register
atexit.register = lambda f, *a, **k: (registered.append(getattr(f, "__name__", str(f))), atexit_register(f, *a, **k))[1]
out = {}
for name in sys.argv[1:]:
    t0 = time.process_time()  # CPU time: other jobs sharing the cores do not inflate it
    try:
        importlib.import_module(name)
        out[name] = {"seconds": time.process_time() - t0}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
out["__atexit__"] = registered
out["__lightning_loaded__"] = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    names = core_modules()
    proc = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_technique_has_a_core():
    names = core_modules()
    for technique in (
        "kfac",
        "layered_sgd",
        "hybrid_fc",
        "spatial",
        "multigrid",
        "horovod",
        "distributed",
        "perfmodel",
    ):
        assert any(n.startswith(f"lightning_hpc.{technique}.") for n in names), technique


def test_cores_import_with_lightning_blocked(probe):
    failed = {k: v["error"] for k, v in probe.items() if isinstance(v, dict) and "error" in v}
    assert not failed, f"cores that need Lightning: {failed}"
    assert probe["__lightning_loaded__"] == []


def test_cores_import_quickly(probe):
    # cumulative: a module's time includes the first import of what it shares with others; all of them together
    # must stay well under a second each on average, and none alone may take a second
    times = {k: v["seconds"] for k, v in probe.items() if isinstance(v, dict) and "seconds" in v}
    slow = {k: round(t, 3) for k, t in times.items() if t > 1.0}
    assert not slow, f"cores taking over a second to import: {slow}"


def test_importing_cores_installs_no_exit_handler(probe):
    assert probe["__atexit__"] == [], probe["__atexit__"]

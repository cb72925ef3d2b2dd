"""Every module of the package imports, Lightning present: the first thing a torch release the package does not
support breaks (a torch name missing at import time), named per module.  In the torch-range subset, which runs it
on the oldest and newest torch release ``pyproject.toml`` admits (``bash scripts/dev.sh torch-range``)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hpc

pytestmark = pytest.mark.torch_range

PROBE = r"""
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def package_modules() -> list[str]:
    """Every module of the package but ``__main__`` (importing it runs the command line)."""
    root = Path(lightning_hpc.__file__).parent
    return sorted(info.name for info in pkgutil.walk_packages([str(root)], prefix="lightning_hpc.")
                  if not info.name.endswith(".__main__"))


def test_every_module_imports():
    names = package_modules()
    assert len(names) > 100, names  # the walk found the package's modules, not an empty folder
    # a fresh interpreter: the modules this pytest process imported already would hide a failing import
    proc = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "modules that do not import with this torch / Lightning:\n" + "\n".join(
        f"  {k}: {v}" for k, v in failed.items())

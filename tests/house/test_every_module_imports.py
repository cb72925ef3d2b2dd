"""Every module of the package imports, Lightning present: the first thing a torch release the package does not
support breaks (a torch name missing at import time), named per module.  In the torch-range subset, which runs it
on the oldest and newest torch release ``pyproject.toml`` admits (``bash scripts/dev.sh torch-range``)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import lightning_hpc

pytestmark = pytest.mark.torch_range


def package_modules() -> list[str]:
    """Every module of the package but ``__main__`` (importing it runs the command line)."""
    root = Path(lightning_hpc.__file__).parent
    return sorted(info.name for info in pkgutil.walk_packages([str(root)], prefix="lightning_hpc.")
                  if not info.name.endswith(".__main__"))


def test_every_module_imports():
    # in this process: a module whose import failed is not kept in sys.modules, so an earlier failed import (in
    # another test's collection) fails here again rather than being hidden
    names = package_modules()
    assert len(names) > 100, names  # the walk found the package's modules, not an empty folder
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every module's failure is reported, not the first only
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert not failed, "modules that do not import with this torch / Lightning:\n" + "\n".join(
        f"  {k}: {v}" for k, v in failed.items())

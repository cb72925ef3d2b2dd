"""Where the Hydra config groups (``conf/``) and the recipes (``recipes/``) are.

In a checkout they sit beside the package; in an installed wheel they are packaged as ``lightning_hpc/conf``
and ``lightning_hpc/recipes`` (see pyproject.toml), so ``lightning-hpc train`` works from a plain install.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["conf_dir", "recipes_dir", "recipe_names"]

_PKG = Path(__file__).resolve().parent.parent  # the lightning_hpc package folder


def _find(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"lightning_hpc: cannot find its {name}/ folder next to {_PKG}; reinstall the package")


def conf_dir() -> Path:
    return _find("conf")


def recipes_dir() -> Path:
    return _find("recipes")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))

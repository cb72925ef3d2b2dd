"""The GPU tier (``pytest -m gpu tests/gpu``, or ``bash scripts/gpu_check.sh`` for the whole check with figures).

Every test here is marked ``gpu`` and skipped, with the reason, where CUDA is not available.  The tier compares
what runs on the GPU with the same computation on the CPU, whose parallel paths the default suite proves against
one process.  ``LIGHTNING_HPC_GPU_TIER_DEVICE=cpu`` runs the tier's own code on the CPU instead: the comparisons
are then CPU against CPU, a check of the tests' plumbing, not of CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("LIGHTNING_HPC_GPU_TIER_DEVICE", "cuda")
NO_DEVICE_REASON = (
    "no CUDA device: the GPU tier runs on a GPU machine (bash scripts/gpu_check.sh); "
    "LIGHTNING_HPC_GPU_TIER_DEVICE=cpu dry-runs its code on the CPU"
)


def device_available() -> bool:
    return DEVICE == "cpu" or torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=NO_DEVICE_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not device_available():
                item.add_marker(skip)


def load_conformance(name: str) -> ModuleType:
    """A module of ``tests/conformance`` under a name of its own (``tests/cluster`` has a ``launch`` too)."""
    path = HERE.parent / "conformance" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"conformance_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest absolute difference over all parameters, and the largest parameter magnitude (the scale)."""
    assert a.keys() == b.keys()
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    scale = max(float(a[k].double().abs().max()) for k in a)
    return diff, scale

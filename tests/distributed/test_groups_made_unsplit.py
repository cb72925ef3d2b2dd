"""``_compat.groups_made_unsplit``: new groups are made afresh where the world's backend claims to split but cannot.

torch 2.11's gloo backend reports ``supports_splitting`` without ``perform_nocolor_split``; on a world bound to a
GPU (Lightning binds it) every gloo group that leaves a rank out failed on that rank (found with two ranks sharing
one GPU under ``layered_sgd``).  The installed torch's gloo has the method, so the case is built from stand-ins.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_hpc import _compat


class _Backend:
    supports_splitting = True


class _SplittingBackend(_Backend):
    def perform_nocolor_split(self, device: torch.device) -> None:  # pragma: no cover - never called here
        raise AssertionError


def _world(backend: Any, device: torch.device | None) -> SimpleNamespace:
    return SimpleNamespace(bound_device_id=device, _get_backend=lambda d: backend)


def _patch(monkeypatch: pytest.MonkeyPatch, world: SimpleNamespace) -> None:
    fake = SimpleNamespace(is_initialized=lambda: True, group=SimpleNamespace(WORLD=world))
    monkeypatch.setattr(_compat, "dist", fake)


def test_unbinds_while_made_and_rebinds_after(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda", 0)
    world = _world(_Backend(), device)
    _patch(monkeypatch, world)
    with _compat.groups_made_unsplit():
        assert world.bound_device_id is None
    assert world.bound_device_id == device


def test_rebinds_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda", 0)
    world = _world(_Backend(), device)
    _patch(monkeypatch, world)
    with pytest.raises(RuntimeError, match="boom"), _compat.groups_made_unsplit():
        raise RuntimeError("boom")
    assert world.bound_device_id == device


@pytest.mark.parametrize("backend", [_SplittingBackend(), SimpleNamespace(supports_splitting=False), None])
def test_leaves_a_world_that_splits_or_does_not_claim_to(monkeypatch: pytest.MonkeyPatch, backend: Any) -> None:
    device = torch.device("cuda", 0)
    world = _world(backend, device)
    _patch(monkeypatch, world)
    with _compat.groups_made_unsplit():
        assert world.bound_device_id == device


def test_leaves_an_unbound_world(monkeypatch: pytest.MonkeyPatch) -> None:
    world = _world(_Backend(), None)
    _patch(monkeypatch, world)
    with _compat.groups_made_unsplit():
        assert world.bound_device_id is None

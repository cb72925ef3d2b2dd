"""One process training with ``torch.optim.LBFGS`` (the reference of the split strategies' LBFGS tests) and the
comparisons of a split run's model and optimizer state with it (float64, 1e-9)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """One ``optimizer.step(closure)`` per batch, the closure re-evaluating ``loss_fn(model(x), y)``."""
    for x, y in batches:

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)


def assert_state_close(state: dict, reference: dict, what: str) -> None:
    """The same keys, shapes and values (1e-9) as ``reference``."""
    assert list(state) == list(reference), what
    for key, value in reference.items():
        assert state[key].shape == value.shape, (what, key)
        assert torch.allclose(state[key], value, rtol=0, atol=1e-9), (what, key, (state[key] - value).abs().max())


def assert_lbfgs_state_close(saved: dict, expected: dict) -> None:
    """An LBFGS ``state_dict`` equal to ``expected`` (one process's): its one state under the first parameter,
    the flat vectors and the curvature pairs to 1e-9."""
    assert saved["param_groups"] == expected["param_groups"]
    assert list(saved["state"]) == list(expected["state"]) == [0]
    for key, value in expected["state"][0].items():
        got = saved["state"][0][key]
        if isinstance(value, list):
            assert len(got) == len(value), key
            for a, b in zip(got, value):
                assert b is None or torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=0, atol=1e-9), key
        elif torch.is_tensor(value):
            assert got.shape == value.shape and torch.allclose(got, value, rtol=0, atol=1e-9), key
        else:
            assert got == pytest.approx(value, rel=0, abs=1e-9), key

"""What K-FAC's steps cost a GPU in host work, bounded on the CPU (``bench/kfac_launches.py``, on the routes a GPU
takes): the kernels each step kind launches beyond SGD's, per preconditioned layer, and the host round trips.

On a GPU these steps are bound by their launches (``bench/reports/2026-11-28-kfac-launches.md``). The bounds sit
just above today's counts of a MobileNetV3-style net (88 layers, every kind: convolutions, depthwise, BatchNorm,
squeeze-excite, Linear); the per-layer code they replaced made about twice as many (precondition 14.8, factor
step 32.8 per layer; 21 uploads per factor step), so a return to per-layer chains fails here. The decompositions
alone (the decomposing step beyond a factor step) made 31.1 launches and 3.2 host read-backs per layer with one
``eigh`` per factor (284 read-backs); batched by side length (:mod:`lightning_hpc.kfac.batched_decompositions`)
7.0, and one read-back per batch (34); 8.6 with Eq 14's damped reciprocals formed there, once per decomposition,
instead of at every preconditioning step (3.6 launches per layer there, from 4.1). The preconditioning's host
Python is bounded the same way, by a count
(``bench/kfac_launches.py --host``): 107.8 Python calls per layer when every step rebuilt its gradient matrices,
bucket keys and stacks' checks and wrote each layer back (and 6.75 launches per layer), 6.4 (and 4.1) with the plan
kept between steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from kfac_launches import count  # noqa: E402

from lightning_hpc.kfac.linalg import accelerator_routes  # noqa: E402


@pytest.fixture(scope="module")
def mobilenet_counts() -> dict:
    with accelerator_routes():
        return count("mobilenetv3", 32, 2, decomp=True, sites=0)


def test_preconditioning_launches_per_layer(mobilenet_counts: dict) -> None:
    assert mobilenet_counts["layers"] == 88
    # 6.75 when every step stacked, padded or concatenated the gradient matrices and wrote each layer back; 4.09
    # when every step formed Eq 14's damped eigenvalue products (outer product, sum, division) anew
    assert mobilenet_counts["precondition_added_per_layer"] <= 3.75, mobilenet_counts


def test_factor_step_launches_per_layer(mobilenet_counts: dict) -> None:
    assert mobilenet_counts["factors_added_per_layer"] <= 20.0, mobilenet_counts


def test_host_round_trips_do_not_grow_with_layers(mobilenet_counts: dict) -> None:
    """A preconditioning step (KL clip included) makes no host round trip at all once its learning rates have been
    uploaded (its nu stays on the device; the per-layer code read every product back, the bucketed code before
    this one still read them back once per step); a factor step reads back once, for the finiteness check."""
    assert mobilenet_counts["precondition_syncs"] == 0
    assert mobilenet_counts["precondition_uploads"] == 0
    assert mobilenet_counts["factors_syncs"] <= 1
    assert mobilenet_counts["factors_uploads"] <= 1, mobilenet_counts


def test_decomposition_launches_per_layer(mobilenet_counts: dict) -> None:
    """One batched solver per side length, not one per factor: launches and read-backs per batch. (7.8 before Eq
    14's damped reciprocals were kept with the stacked decompositions: they are now formed once per decomposition,
    in the first step after it, not at every step.)"""
    assert mobilenet_counts["decompositions_launches_per_layer"] <= 8.75, mobilenet_counts
    # one read-back per batch of equal-sized factors (MobileNetV3's 34 side lengths), not two per factor
    assert mobilenet_counts["decompositions_syncs"] <= 40, mobilenet_counts


def test_preconditioning_python_calls_per_layer(mobilenet_counts: dict) -> None:
    """The host's Python of a step that only preconditions, per layer (``cProfile``: Python functions and the
    builtins and torch functions they call; as deterministic as the launches): one group of calls per bucket, not
    per layer, once the plan is kept (6.4 per layer); every step's gradient matrices, bucket keys, stacked
    decompositions' checks, per-layer write-back, KL-clip learning-rate search and statistics resets made 107.8."""
    assert mobilenet_counts["precondition_python_calls_per_layer"] <= 10.0, mobilenet_counts

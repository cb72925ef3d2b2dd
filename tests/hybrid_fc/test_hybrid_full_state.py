"""The strategy's way of saving (gathered to rank 0 in buckets, into host memory) writes the serial model's
checkpoint: saved on 2 ranks, it loads into one process (the plain model) and onto 4 ranks, and training goes on
as the serial model does."""

from __future__ import annotations

import numpy as np
from hybrid_workers import HEAD_WEIGHT_SHAPES, checkpoint_from_hybrid_rank0, checkpoint_into_hybrid, serial_continue

from lightning_hpc.distributed import run_in_processes


def test_saved_on_2_ranks_loads_on_1_and_4(tmp_path):
    path = str(tmp_path / "hybrid.pt")
    steps = 2
    out = run_in_processes(checkpoint_from_hybrid_rank0, 2, path, steps, timeout_s=240)
    # rank 0 wrote full tensors; rank 1 kept its shards (nothing full was built there)
    assert [out[0]["saved_shapes"][f"{i}.weight"] for i in (4, 6, 8)] == HEAD_WEIGHT_SHAPES
    assert out[1]["saved_shapes"]["4.weight"] == (12, 64) and out[1]["saved_shapes"]["8.weight"] == (10, 9)
    # one process loads it into the plain model and optimizer (strict) and takes the same step as the 2 ranks
    serial_state, _ = serial_continue(path, 2, steps)
    for key, value in serial_state.items():
        assert np.allclose(value, out[0]["state"][key], atol=1e-5, rtol=0), key
    # 4 ranks load it (re-sharded: model and optimizer state) and take the serial model's next step
    back = run_in_processes(checkpoint_into_hybrid, 4, path, steps, timeout_s=240)
    reference, _ = serial_continue(path, 4, steps)
    for key, value in reference.items():
        assert np.allclose(value, back[0]["state"][key], atol=1e-5, rtol=0), key

"""Each rank holds 1/K of the head and its optimizer state; full checkpoints move between 4 ranks and 1."""

from __future__ import annotations

import numpy as np
from hybrid_workers import checkpoint_from_hybrid, checkpoint_into_hybrid, memory_and_errors, serial_continue

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_sizes

K = 4


def test_each_rank_holds_one_kth_of_head_and_optimizer_state():
    out = run_in_processes(memory_and_errors, K, timeout_s=240)
    full = out[0]["head_full"]
    assert sum(o["head_local"] for o in out) == full
    # 1/K up to the uneven neuron blocks (18 = 5+5+4+4, 10 = 3+3+2+2 over 4 ranks)
    for o in out:
        assert o["head_local"] <= full // K + 64, o
        assert o["head_local"] >= full // K - 64, o
        assert o["head_state_local"] == o["head_local"], "SGD momentum must exist only for this rank's shard"
    # layouts col, col, row: weights 64->24 split by rows, 24->18 by rows, 18->10 by columns (input neurons)
    assert [o["shapes"][0] for o in out] == [(s, 64) for s in block_sizes(24, K)]
    assert [o["shapes"][4] for o in out] == [(10, s) for s in block_sizes(18, K)]
    # a batch of fewer examples per rank than scheme c's K slices runs as one sub-batch: the whole model's logits
    assert all(o["small_batch_diff"] < 1e-6 for o in out), [o["small_batch_diff"] for o in out]


def test_checkpoint_round_trip_4_ranks_1_rank_4_ranks(tmp_path):
    path = str(tmp_path / "hybrid.pt")
    steps = 2
    # 4 ranks train, save a full checkpoint, and continue one step.
    continued_on_4 = run_in_processes(checkpoint_from_hybrid, K, path, steps, timeout_s=240)[0]
    # 1 process loads it into the plain model + optimizer and does the same step: identical.
    serial_state, serial_path = serial_continue(path, K, steps)
    for key, value in serial_state.items():
        assert np.allclose(value, continued_on_4[key], atol=1e-5, rtol=0), key
    # ... and back: the plain checkpoint loads on 4 ranks (sharded on load) and the next step matches serial.
    back = run_in_processes(checkpoint_into_hybrid, K, serial_path, steps + 1, timeout_s=240)
    reference, _ = serial_continue(serial_path, K, steps + 1)
    assert sum(r["head_local"] for r in back) == sum(
        serial_state[k].size for k in serial_state if k.split(".")[0] in {"4", "6", "8"}
    )
    for key, value in reference.items():
        assert np.allclose(value, back[0]["state"][key], atol=1e-5, rtol=0), key

"""``torch.optim.LBFGS`` under ``strategy='hybrid_fc'``: its flat vectors are the whole model's on every rank (the
head's blocks gathered, each rank updating its block with its slice of the whole step, the loss the global
batch's), so ``Trainer.fit`` on 2 processes trains as one process on the global batch, with and without the
strong-Wolfe line search, with head widths that split unevenly, and a checkpoint written while the head is split
resumes exactly and holds LBFGS's state as one process writes it."""

from __future__ import annotations

import pytest
import torch
from hybrid_workers import LBFGS_STEPS, hybrid_lbfgs, lbfgs_batch, lbfgs_cnn, serial_lbfgs

from lightning_hpc.distributed import run_in_processes
from tests.lbfgs_reference import assert_lbfgs_state_close, assert_state_close

K = 2


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"], ids=["fixed_step", "strong_wolfe"])
@pytest.mark.parametrize("width", [8, 7], ids=["even_head", "uneven_head"])
def test_lbfgs_fit_equals_one_process(line_search, width):
    out = run_in_processes(hybrid_lbfgs, K, line_search, width, timeout_s=400, collective_timeout_s=60)
    reference, _ = serial_lbfgs(K, line_search, width)
    for rank, o in enumerate(out):
        assert o["steps"] == LBFGS_STEPS, rank
        assert_state_close(o["state"], reference, f"rank {rank}")
        # handed back: the optimizer is over the user's whole parameters
        assert o["optimizer_shapes"] == [tuple(p.shape) for p in lbfgs_cnn(line_search, width).parameters()], rank


@pytest.mark.parametrize("head_first", [False, True], ids=["model_order", "head_first"])
def test_lbfgs_checkpoint_of_the_split_run_is_one_process_state_and_resumes_exactly(tmp_path, head_first):
    """``head_first``: LBFGS's first parameter (the one its state is kept under) is a head block; its state is
    still the whole model's flat vectors, written and resumed as they are (not cut as a block's state)."""
    line_search, width = "strong_wolfe", 7
    first = run_in_processes(hybrid_lbfgs, K, line_search, width, str(tmp_path), None, head_first, timeout_s=400,
                             collective_timeout_s=60)
    reference, _ = serial_lbfgs(K, line_search, width, head_first=head_first)
    assert_state_close(first[0]["state"], reference, "saving run")
    # the checkpoint after the first epoch (2 steps, written while the head was split) is one process's
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", map_location="cpu", weights_only=False)
    at_two, optimizer_at_two = serial_lbfgs(K, line_search, width, steps=2, head_first=head_first)
    assert_state_close(checkpoint["state_dict"], at_two, "checkpoint")
    assert_lbfgs_state_close(checkpoint["optimizer_states"][0], optimizer_at_two)
    resumed = run_in_processes(hybrid_lbfgs, K, line_search, width, None, str(tmp_path / "epoch=0.ckpt"), head_first,
                               timeout_s=400, collective_timeout_s=60)
    for rank, o in enumerate(resumed):
        assert o["steps"] == LBFGS_STEPS, rank
        assert_state_close(o["state"], reference, f"resumed rank {rank}")


def _per_subbatch(rank: int, k: int) -> str | None:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import HybridParallelStrategy
    from tests import fit_harness

    x, y = lbfgs_batch(0, 1)
    run = fit_harness.fit(lbfgs_cnn(None, 8), DataLoader(TensorDataset(x, y), batch_size=len(x)), devices=k,
                          strategy=HybridParallelStrategy(fc_update="per_subbatch"), precision="64-true",
                          max_steps=1, use_distributed_sampler=False, refusal_is_result=True)
    assert run.steps == 0
    return run.error


def test_lbfgs_with_the_per_subbatch_head_update_is_refused_before_the_first_step():
    """The per-sub-batch update steps the head inside the forward pass, without a closure to re-evaluate."""
    for error in run_in_processes(_per_subbatch, K, timeout_s=300, collective_timeout_s=60):
        assert error is not None and "fc_update='per_subbatch'" in error and "fc_update='per_step'" in error

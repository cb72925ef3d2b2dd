"""``torch.optim.LBFGS`` under ``strategy='multigrid'`` (mode 'pm'): its flat vectors are the whole model's on
every rank (each rank's residual steps' gradients gathered over the layer group, in the serial model's order;
each rank updating its steps with their slice of the whole step), so ``Trainer.fit`` on 2 layer ranks trains as
one process, with and without the strong-Wolfe line search, and a checkpoint written while the trunk is split
holds LBFGS's state as one process writes it and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from mg_lightning_workers import LBFGS_STEPS, lbfgs_odenet, multigrid_lbfgs, serial_lbfgs_odenet

from lightning_hpc.distributed import run_in_processes
from tests.lbfgs_reference import assert_lbfgs_state_close, assert_state_close


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"], ids=["fixed_step", "strong_wolfe"])
def test_lbfgs_fit_equals_one_process(line_search):
    out = run_in_processes(multigrid_lbfgs, 2, line_search, timeout_s=400, collective_timeout_s=120)
    reference, _ = serial_lbfgs_odenet(line_search)
    for rank, o in enumerate(out):
        assert o["steps"] == LBFGS_STEPS, rank
        assert_state_close(o["state"], reference, f"rank {rank}")
        assert o["optimizer_shapes"] == [tuple(p.shape) for p in lbfgs_odenet(line_search).parameters()], rank


@pytest.mark.parametrize("steps_first", [False, True], ids=["model_order", "trunk_first"])
def test_lbfgs_checkpoint_of_the_split_run_is_one_process_state_and_resumes_exactly(tmp_path, steps_first):
    """``trunk_first``: LBFGS's first parameter (the one its state is kept under) is a residual step, a different
    one on each rank: the checkpoint holds the state under the serial model's first parameter only, and every
    rank resumes with it."""
    line_search = "strong_wolfe"
    first = run_in_processes(multigrid_lbfgs, 2, line_search, str(tmp_path), None, steps_first,
                             timeout_s=400, collective_timeout_s=120)
    reference, _ = serial_lbfgs_odenet(line_search, steps_first=steps_first)
    assert_state_close(first[0]["state"], reference, "saving run")
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", map_location="cpu", weights_only=False)
    at_two, optimizer_at_two = serial_lbfgs_odenet(line_search, steps=2, steps_first=steps_first)
    assert_state_close(checkpoint["state_dict"], at_two, "checkpoint")
    assert_lbfgs_state_close(checkpoint["optimizer_states"][0], optimizer_at_two)
    resumed = run_in_processes(multigrid_lbfgs, 2, line_search, None, str(tmp_path / "epoch=0.ckpt"), steps_first,
                               timeout_s=400, collective_timeout_s=120)
    for rank, o in enumerate(resumed):
        assert o["steps"] == LBFGS_STEPS, rank
        assert_state_close(o["state"], reference, f"resumed rank {rank}")

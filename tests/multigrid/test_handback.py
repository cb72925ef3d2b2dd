"""After a stage the model is the user's again: the strategy puts the user's trunk back with every residual step
and its trained weights on every rank, so the module's state loads strictly into a fresh instance of the user's
class and its forward runs on one rank alone, as one process's trained model does."""

from __future__ import annotations

import pytest
import torch
from mg_lightning_workers import handed_back_odenet, serial_user_odenet, user_odenet

from lightning_hpc.distributed import run_in_processes

STEPS = 2


@pytest.mark.parametrize(
    "mode,also_test", [("pm", False), ("mg", False), ("pm", True)], ids=["pm_fit", "mg_fit", "pm_fit_then_test"]
)
def test_fit_hands_back_the_users_trunk_whole_on_every_rank(mode, also_test):
    out = run_in_processes(handed_back_odenet, 2, mode, STEPS, also_test, timeout_s=400, collective_timeout_s=120)
    # one process trains the same model on the same batches; 'pm' is the serial evaluation, 'mg' an exact
    # solve (4 cycles for 16 steps with c = 4): both are one process's training up to rounding
    reference, reference_optimizer = serial_user_odenet(STEPS, with_optimizer=True)
    for rank, o in enumerate(out):
        assert o["trunk_type"] == "Sequential" and o["steps"] == [str(i) for i in range(16)], rank
        assert list(o["state"]) == list(reference), rank
        for key, value in reference.items():
            assert torch.allclose(o["state"][key], value, rtol=0, atol=1e-9), (rank, key)
        assert o["optimizer_shapes"] == [tuple(p.shape) for p in user_odenet().parameters()], rank
        # after fit (and after a test stage that split the trunk again) the optimizer is one process's: over the
        # module's whole parameters, with one process's momentum buffers (a checkpoint written now continues the run)
        assert o["optimizer_holds_module_parameters"], rank
        assert list(o["optimizer_state"]) == list(reference_optimizer), rank
        for name, entry in reference_optimizer.items():
            momentum = entry["momentum_buffer"]
            got = o["optimizer_state"][name]["momentum_buffer"]
            assert got.shape == momentum.shape, (rank, name)
            assert torch.allclose(got, momentum, rtol=0, atol=1e-9), (rank, name)
    serial = user_odenet()
    serial.load_state_dict(reference)
    with torch.no_grad():
        expected = serial(torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    assert torch.allclose(out[0]["logits"], expected, rtol=0, atol=1e-9)
    assert torch.allclose(out[0]["fresh_logits"], expected, rtol=0, atol=1e-9)

"""After a stage the model is the user's again: the strategy hands back the user's ``nn.Sequential`` head with
the full trained weights on every rank, so its state loads strictly into a fresh instance of the user's class
and its forward runs on one rank alone, as one process's trained model does."""

from __future__ import annotations

import pytest
import torch
from hybrid_workers import batch, handed_back_cnn, handed_back_cnn_in_eval_mode, serial_user_cnn, user_cnn

from lightning_hpc.distributed import run_in_processes

STEPS = 3


@pytest.mark.parametrize("also_test, compiled", [(False, False), (True, False), (False, True)],
                         ids=["fit", "fit_then_test", "fit_compiled_head"])
def test_fit_hands_back_the_users_model_whole_on_every_rank(also_test, compiled):
    """``compiled``: the user's head is ``torch.compile``'d; it trains as one process does, and its compiled module
    calls the user's head again after fit (not the split one the strategy trained: that one's forward would need
    the peer rank)."""
    k = 2
    out = run_in_processes(handed_back_cnn, k, STEPS, also_test, compiled, timeout_s=400, collective_timeout_s=60)
    reference = serial_user_cnn(k, STEPS)
    for rank, o in enumerate(out):
        assert o["classifier_type"] == "Sequential" and o["last_layer"] == "Linear", rank
        assert list(o["state"]) == list(reference), rank
        for key, value in reference.items():  # whole tensors, one process's trained values
            assert o["state"][key].shape == value.shape, (rank, key)
            assert torch.allclose(o["state"][key], value, rtol=0, atol=1e-9), (rank, key)
        # the optimizer is over the whole parameters too (a checkpoint after fit needs no gather)
        assert o["optimizer_shapes"] == [tuple(p.shape) for p in user_cnn().parameters()], rank
        assert o["optimizer_holds_module_parameters"], rank
    serial = user_cnn()
    serial.load_state_dict(reference)
    with torch.no_grad():
        expected = serial(batch(STEPS, k, torch.float64)[0])
    assert torch.allclose(out[0]["logits"], expected, rtol=0, atol=1e-9)
    assert torch.allclose(out[0]["fresh_logits"], expected, rtol=0, atol=1e-9)


def test_the_handed_back_head_keeps_the_mode_the_model_was_left_in():
    """A callback puts the model in eval mode when training ends, while the head is still split (ready for
    inference, as users do): the head handed back after fit is in eval mode with the rest of the model, as one
    process's model is, so its dropout is off and its logits are those of the same weights in eval mode."""
    k = 2
    out = run_in_processes(handed_back_cnn_in_eval_mode, k, STEPS, timeout_s=400, collective_timeout_s=60)
    for rank, o in enumerate(out):
        assert o["modes"] and not any(o["modes"].values()), (rank, o["modes"])
    serial = user_cnn(dropout=True)
    serial.load_state_dict(out[0]["state"])
    serial.eval()
    with torch.no_grad():
        expected = serial(batch(STEPS, k, torch.float64)[0])
    assert torch.allclose(out[0]["logits"], expected, rtol=0, atol=1e-12)

"""KFAC under strategy='hybrid_fc' hooks the layers that run: the trunk's, after the head is sharded.

Before: the callback hooked the model's nn.Linear head layers in its ``setup``; the strategy then replaced them by
sharded layers, so their hooks never fired, every step warned "the hooks of layer 'model.7' (Linear) did not fire
... (used functionally, output unused, or shared oddly)" and nothing said that the head is not preconditioned.
"""

import warnings

import lightning.pytorch as pl
import numpy as np
import torch
from hybrid_workers import lightning_equivalence, serial_kfac_trunk_params
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC, HybridParallelStrategy, ImageClassifier
from lightning_hpc.distributed import run_in_processes


def test_kfac_hooks_the_trunk_and_says_the_head_is_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
                          nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    module = ImageClassifier(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_classes=10)
    kfac = KFAC(factor_update_freq=1, inv_update_freq=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HybridParallelStrategy(), max_steps=2, callbacks=[kfac], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader)
    messages = [str(w.message) for w in caught]
    assert any("KFAC preconditions only the data-parallel trunk under strategy='hybrid_fc'" in m for m in messages)
    assert not [m for m in messages if "did not fire" in m], messages
    assert [h.name for h in kfac.preconditioner.handlers] == ["model.0"]  # the conv; the head is sharded
    assert "model.0" in kfac.preconditioner.decompositions  # and it was preconditioned


def test_two_ranks_with_kfac_equal_serial_kfac_on_the_trunk(tmp_path):
    """hybrid_fc (2 ranks, scheme c, per-step head update) + KFAC equals one process on the concatenated batches
    with K-FAC on the trunk only (the head left to SGD), after 3 steps, at 1e-5."""
    out = run_in_processes(lightning_equivalence, 2, "c", "per_step", 3, str(tmp_path / "h.ckpt"), True, timeout_s=400)
    reference = {key: v.numpy() for key, v in serial_kfac_trunk_params(2, 3).items()}
    for key, value in reference.items():
        assert np.abs(out[0]["state"][key] - value).max() < 1e-5, key
    plain_sgd = run_in_processes(lightning_equivalence, 2, "c", "per_step", 3, str(tmp_path / "s.ckpt"), timeout_s=400)
    # and K-FAC did change the trunk (the comparison is not SGD against SGD)
    assert np.abs(plain_sgd[0]["state"]["0.weight"] - reference["0.weight"]).max() > 1e-4

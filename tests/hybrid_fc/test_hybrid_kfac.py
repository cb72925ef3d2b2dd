"""KFAC under strategy='hybrid_fc': the trunk's layers and the sharded head's, each head layer preconditioned as
the whole layer (factors over the whole input and output, from every sample; the whole gradient), as one process
does it.

History: the callback once hooked the model's nn.Linear head layers in its ``setup``, which the strategy then
replaced by sharded layers (their hooks never fired); after that it preconditioned the trunk only and left the
head to the optimizer, so 2 ranks differed from one K-FAC process on the same samples (0.69 on the conformance
CNN after 4 steps).
"""

import numpy as np
import pytest
import torch
from hybrid_workers import lightning_equivalence, serial_kfac_params
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC, HybridParallelStrategy, ImageClassifier
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac.layers import ShardedLinearHandler
from tests import fit_harness


def _classifier_and_loader() -> tuple[ImageClassifier, DataLoader]:
    """The conv trunk and two-layer head, and 8 random samples drawn after it (in this order from seed 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
                          nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    module = ImageClassifier(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_classes=10)
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))), batch_size=4)
    return module, loader


#: two steps, no validation
RUN = dict(max_steps=2, num_sanity_val_steps=0, limit_val_batches=0)


def test_kfac_preconditions_the_trunk_and_the_sharded_head():
    kfac = KFAC(factor_update_freq=1, inv_update_freq=1)
    module, loader = _classifier_and_loader()
    run = fit_harness.fit(module, loader, strategy=HybridParallelStrategy(), callbacks=[kfac], record_warnings=True,
                          **RUN)
    messages = run.warnings
    assert not [m for m in messages if "did not fire" in m or "left to the optimizer" in m], messages
    pre = kfac.preconditioner
    assert [h.name for h in pre.handlers] == ["model.0", "model.4", "model.6"]
    assert all(isinstance(h, ShardedLinearHandler) for h in pre.handlers[1:])
    assert set(pre.decompositions) == {"model.0", "model.4", "model.6"}
    assert "model.4 (ShardedLinear)" in pre.describe_layers()
    # the whole layers' factors: A over the inputs and the bias, G over the outputs
    assert tuple(pre.factors["model.4"]["A"].shape) == (65, 65)
    assert tuple(pre.factors["model.6"]["G"].shape) == (10, 10)


def test_per_subbatch_head_update_is_refused_before_the_first_step():
    kfac = KFAC(factor_update_freq=1, inv_update_freq=1)
    per_subbatch = HybridParallelStrategy(scheme="c", fc_update="per_subbatch")
    with pytest.raises(ValueError, match=r"fc_update='per_subbatch'.*Use fc_update='per_step'"):
        fit_harness.fit(*_classifier_and_loader(), strategy=per_subbatch, callbacks=[kfac], **RUN)
    assert kfac.preconditioner is None


@pytest.mark.parametrize("layouts", [None, ["row", "row", "col"]], ids=["planned", "row-row-col"])
def test_two_ranks_with_kfac_equal_serial_kfac_on_every_layer(tmp_path, layouts):
    """hybrid_fc (2 ranks, scheme c, per-step head update) + KFAC equals one process on the concatenated batches
    with K-FAC on every layer, after 3 steps, at 1e-5 (float32); the planned layouts and row blocks first (a
    row layer's input factor and a column layer's output factor are gathered; 18 and 10 outputs split unevenly
    into the bias blocks)."""
    out = run_in_processes(lightning_equivalence, 2, "c", "per_step", 3, str(tmp_path / "h.ckpt"), True, layouts,
                           timeout_s=400)
    reference = {key: v.numpy() for key, v in serial_kfac_params(2, 3).items()}
    for key, value in reference.items():
        assert np.abs(out[0]["state"][key] - value).max() < 1e-5, key
    # and preconditioning the head matters: K-FAC on the trunk only is far from it
    trunk_only = serial_kfac_params(2, 3, skip_layers="Linear")
    assert max(np.abs(trunk_only[k].numpy() - reference[k]).max() for k in reference) > 1e-3


def test_resumed_run_continues_from_the_checkpointed_factors(tmp_path):
    """hybrid_fc restores a checkpoint after its setup, which Lightning does after ``on_fit_start``: the callback's
    state arrives once the preconditioner exists and is loaded into it then (it used to wait for an
    ``on_fit_start`` that had passed, and the resumed run started K-FAC afresh)."""
    first = fit_harness.fit(*_classifier_and_loader(), strategy=HybridParallelStrategy(),
                            callbacks=[KFAC(factor_update_freq=1, inv_update_freq=1)], **RUN)
    path = tmp_path / "two_steps.ckpt"
    first.trainer.save_checkpoint(path)
    saved = next(c for c in first.trainer.callbacks if isinstance(c, KFAC)).preconditioner
    factors = {n: {k: v.clone() for k, v in f.items()} for n, f in saved.factors.items()}
    resumed = KFAC(factor_update_freq=1, inv_update_freq=1)
    module, loader = _classifier_and_loader()
    fit_harness.trainer(strategy=HybridParallelStrategy(), callbacks=[resumed], **RUN).fit(
        module, train_dataloaders=loader, ckpt_path=path
    )  # nothing left to train: the restored state is kept
    assert resumed.preconditioner.steps == 2
    for name, f in factors.items():
        for k, v in f.items():
            assert torch.equal(resumed.preconditioner.factors[name][k], v), (name, k)

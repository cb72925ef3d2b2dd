"""HybridParallelStrategy through Lightning's Trainer: equivalence, full checkpoints, bad input.  The
alexnet_imagenet recipe (hybrid_fc on 2 processes) runs in tests/test_cli.py's fast_dev_run sweep."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_workers import lightning_equivalence, serial_sequence, small_model
from torch import nn

from lightning_hpc import HybridParallelStrategy, ImageClassifier
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import HeadNotFoundError, find_head
from lightning_hpc.models import alexnet_one_tower, small_cnn

STEPS = 3


@pytest.mark.parametrize("scheme,fc_update", [("c", "per_step"), ("b", "per_subbatch")])
def test_trainer_matches_serial_and_checkpoint_loads_into_plain_model(tmp_path, scheme, fc_update):
    k = 2
    ckpt = str(tmp_path / "hybrid.ckpt")
    out = run_in_processes(lightning_equivalence, k, scheme, fc_update, STEPS, ckpt, timeout_s=400)
    reference = serial_sequence(k, STEPS, fc_update, scheme)
    for key, value in reference.items():
        assert np.abs(out[0]["state"][key] - value).max() < 1e-5, key
    # each rank trained only its shard
    full_head = sum(p.numel() for p in small_model()[4:].parameters())
    assert sum(o["head_local"] for o in out) == full_head and max(o["head_local"] for o in out) < full_head
    # the Lightning checkpoint is the full model: it loads into the plain, unsharded module
    plain = ImageClassifier(small_model(seed=5), num_classes=10)
    state = torch.load(ckpt, weights_only=False)
    plain.load_state_dict(state["state_dict"])
    for key, value in reference.items():
        assert np.abs(plain.model.state_dict()[key].numpy() - value).max() < 1e-5, key
    momentum = state["optimizer_states"][0]["state"]
    assert momentum[len(momentum) - 2]["momentum_buffer"].shape == (10, 18)  # full last-layer weight


def test_head_discovery():
    alex = find_head(alexnet_one_tower(num_classes=10, fc_width=32))
    assert alex.parent_name == "classifier" and alex.whole_parent and len(alex.linears) == 3
    cnn = find_head(small_cnn())
    assert cnn.parent_name == "" and [type(m) for _, m in cnn.modules] == [nn.Dropout, nn.Linear]
    # no convolution, pooling or flatten: the trailing linear layers of the last layer's parent (trunk: the rest)
    mlp = find_head(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert mlp.parent_name == "" and mlp.start == 2 and not mlp.lone
    named = find_head(alexnet_one_tower(num_classes=10, fc_width=32), head="classifier")
    assert [n for n, _ in named.modules] == [n for n, _ in alex.modules] == [str(i) for i in range(7)]


@pytest.mark.parametrize(
    "model,head,match",
    [
        (
            nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
            None,
            r"searched the layers of Sequential for a fully-connected head: it ends with '1' \(LayerNorm\), not an "
            r"nn.Linear.*head='<dotted.path>'.*strategy='ddp'",
        ),
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(1), nn.Linear(8, 2), nn.BatchNorm1d(2)), None, "cannot shard"),
        (nn.Sequential(nn.Flatten(1), nn.Linear(8, 2)), "head", "no such submodule"),
        (alexnet_one_tower(num_classes=10, fc_width=32), "features", "cannot shard"),
        (
            nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3)),
            None,
            "no fully-connected head.*give the model one.*strategy='ddp'",
        ),
    ],
)
def test_bad_models_get_clear_errors(model, head, match):
    with pytest.raises(HeadNotFoundError, match=match):
        find_head(model, head)


def test_bad_strategy_settings():
    with pytest.raises(ValueError, match="strategy.scheme"):
        HybridParallelStrategy(scheme="d")
    with pytest.raises(ValueError, match="strategy.fc_update"):
        HybridParallelStrategy(fc_update="sometimes")
    with pytest.raises(ValueError, match="needs scheme 'b' or 'c'"):
        HybridParallelStrategy(scheme="a", fc_update="per_subbatch")

"""A head built on the meta device is only ever allocated shard by shard (so a head larger than one device can be
trained), is initialised with the serial layer's distribution, and trains exactly like the serial model once the
same full weights are loaded into the shards; through the plain API and through Lightning's init paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_workers import (
    HEAD_WEIGHT_SHAPES,
    lightning_meta_equivalence,
    run_meta_configs,
    serial_sequence,
    small_model,
)

from lightning_hpc import ImageClassifier
from lightning_hpc.distributed import run_in_processes

TOL = 1e-5
FULL_HEAD_NUMEL = sum(o * i + o for o, i in HEAD_WEIGHT_SHAPES)
LARGEST_FULL_BYTES = max(o * i for o, i in HEAD_WEIGHT_SHAPES) * 4


def _assert_sharded_only(out: list[dict], k: int, where: str) -> None:
    assert sum(o["head_numel"] for o in out) == FULL_HEAD_NUMEL, where
    for o in out:
        assert o["full_head_shapes_seen"] == [], (
            f"{where}: a full-size head tensor was allocated: {o['full_head_shapes_seen']}"
        )
        # no tensor of any size beyond the largest full head weight ever had storage
        assert o["max_storage_bytes"] < LARGEST_FULL_BYTES, (
            f"{where}: a {o['max_storage_bytes']}-byte storage was allocated"
        )
        # each rank's head storage is its shards only: 1/K of the head (up to the uneven neuron blocks)
        assert o["head_storage_bytes"] == 4 * o["head_numel"], where
        assert abs(o["head_numel"] - FULL_HEAD_NUMEL / k) <= 64, f"{where}: {o['head_numel']} of {FULL_HEAD_NUMEL}"


@pytest.mark.parametrize("k", [2, 4])
def test_meta_built_head_allocates_only_shards_and_trains_like_serial(k):
    configs = [("c", None), ("b", ["row", "row", "col"])]  # row layouts: the shard's fan-in is not the layer's
    results = run_in_processes(run_meta_configs, k, configs, 3, timeout_s=300)
    for (scheme, layouts), per_rank in zip(configs, zip(*results)):
        where = f"K={k} scheme={scheme} layouts={layouts}"
        _assert_sharded_only([r["meta"] for r in per_rank], k, where)
        for r in per_rank:
            assert r["meta"]["control_seen"] == HEAD_WEIGHT_SHAPES, "the allocation tracker missed a real allocation"
            for what in ("logits", "loss", "params", "input_grad"):
                assert r[what] < TOL, f"{where}: {what} differs by {r[what]:.3g}"
        # nn.Linear's distribution U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the full fan-in: max |w| close to and
        # below the bound, std of a uniform; a shard fan-in (in/K) would exceed the bound by sqrt(K).
        for key, (max_ratio, std_ratio) in per_rank[0]["meta"]["init"].items():
            assert max_ratio <= 1.0, f"{where}: {key} exceeds the serial init bound ({max_ratio:.3f})"
            if key.endswith("weight"):
                assert max_ratio > 0.9 and abs(std_ratio - 1) < 0.2, (
                    f"{where}: {key} max/bound {max_ratio:.3f}, std ratio {std_ratio:.3f}"
                )


@pytest.mark.parametrize("how", ["configure_model", "init_module"])
def test_lightning_meta_init_trains_like_serial_and_saves_full_checkpoint(tmp_path, how):
    k, steps = 2, 3
    init_path, ckpt = str(tmp_path / "init.pt"), str(tmp_path / "meta.ckpt")
    torch.save(small_model().state_dict(), init_path)
    out = run_in_processes(lightning_meta_equivalence, k, how, steps, init_path, ckpt, timeout_s=400)
    assert all(o["built_on_meta"] for o in out)
    _assert_sharded_only(out, k, how)
    reference = serial_sequence(k, steps, "per_step", "c")
    for key, value in reference.items():
        assert np.abs(out[0]["state"][key] - value).max() < TOL, key
    # the checkpoint (gathered to rank 0 tensor by tensor) is the full model
    plain = ImageClassifier(small_model(seed=5), num_classes=10)
    plain.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    for key, value in reference.items():
        assert np.abs(plain.model.state_dict()[key].numpy() - value).max() < TOL, key

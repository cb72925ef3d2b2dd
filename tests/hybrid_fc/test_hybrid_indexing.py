"""While ``hybrid_fc`` trains, the user's ``nn.Sequential`` reads as on one process: ``self.model[-1]``,
``len(self.model)``, slices of trunk children and iteration give the user's children in the user's order (the
head's layers as this rank's shards, whose parameters are blocks of the whole layer's, so clipping, a norm or a
per-class penalty ``w.norm(dim=1)`` over them sees the whole layer); calling a head shard on its own is refused,
naming the fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import fit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import HybridParallelStrategy
from lightning_hpc.distributed import run_in_processes

B, STEPS, K = 4, 3, 2
CLIP = 0.02  # below the last layer's gradient norm at every step: the clipping acts


def _data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS * k * B, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (STEPS * k * B,),
                                                                                                   generator=g)


class IndexesItsModel(pl.LightningModule):
    """Clips its last layer's gradient by ``self.model[-1]`` (timm-style per-layer clipping), adds a per-class
    weight-norm penalty over both head layers (the first split by output neurons, the last by input neurons,
    whichever the strategy plans) and logs the norm of its features through a slice of the trunk,
    ``self.model[:4]``; ``whole_head``: the head is a container of its
    own (``self.classifier``), else the trailing children of ``self.model``."""

    def __init__(self, whole_head: bool, call_a_layer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        trunk = [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1)]
        head = [nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 10)]
        self.whole_head, self.call_a_layer = whole_head, call_a_layer
        if whole_head:
            self.model, self.classifier = nn.Sequential(*trunk), nn.Sequential(*head)
        else:
            self.model = nn.Sequential(*trunk, *head)
        self.seen: list[tuple] = []

    def _head(self) -> nn.Module:
        return self.classifier if self.whole_head else self.model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.model(x)) if self.whole_head else self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.model[:4](x)  # the trunk's children: as on one process
        self.log("feature_norm", features.norm(), sync_dist=True)
        if self.call_a_layer:
            self._head()[-1](torch.zeros(1, 24, dtype=x.dtype))
        head = self._head()
        self.seen.append((len(head), [type(m).__name__ for m in head], type(head[-1]).__name__))
        penalty = sum((head[i].weight.norm(dim=1) - 1).pow(2).sum() for i in (-3, -1))
        return F.cross_entropy(self(x), y) + 1e-2 * penalty

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        total = torch.nn.utils.clip_grad_norm_(self._head()[-1].parameters(), CLIP)
        assert total > CLIP, "the clipping would not act: the test could not tell a partial norm"

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _train(rank: int, world: int, whole_head: bool, call_a_layer: bool = False) -> dict:
    x, y = _data(K)
    # rank r's batches are the r-th quarter of each global batch: one process on the global batches is the reference
    mine = torch.cat([torch.arange(s * K * B + rank * B, s * K * B + (rank + 1) * B) for s in range(STEPS)])
    loader = DataLoader(TensorDataset(x[mine], y[mine]), batch_size=B)
    strategy = HybridParallelStrategy() if world > 1 else "auto"
    run = fit(IndexesItsModel(whole_head, call_a_layer), loader, devices=world, strategy=strategy,
              precision="64-true", max_steps=STEPS, limit_val_batches=0, use_distributed_sampler=False,
              refusal_is_result=call_a_layer)
    module = run.module
    return {"params": run.params, "seen": module.seen if module is not None else [], "error": run.error,
            "feature_norm": run.metric("feature_norm") if not call_a_layer else None}


def _one_process(whole_head: bool) -> dict:
    x, y = _data(K)
    run = fit(IndexesItsModel(whole_head), DataLoader(TensorDataset(x, y), batch_size=K * B), precision="64-true",
              max_steps=STEPS, limit_val_batches=0)
    return {"params": run.params, "seen": run.module.seen}


@pytest.mark.parametrize("whole_head", [False, True], ids=["head_after_trunk", "head_container"])
def test_indexing_the_model_while_training_reads_as_one_process(whole_head):
    results = run_in_processes(_train, K, whole_head, timeout_s=180)
    one = _one_process(whole_head)
    for rank, res in enumerate(results):
        assert res["error"] is None, res["error"]
        length, types, last = one["seen"][0]
        assert last == "Linear" and types[-1] == "Linear"
        for seen in res["seen"]:  # the user's children in the user's order; the head's linear layers are shards
            assert seen[0] == length and seen[2] == "ShardedLinear", (rank, seen)
            assert [t.replace("ShardedLinear", "Linear") for t in seen[1]] == types, (rank, seen)
        assert len(res["params"]) == len(one["params"])
        for got, want in zip(res["params"], one["params"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_calling_a_head_layer_on_its_own_is_refused_naming_the_fix():
    results = run_in_processes(_train, K, False, True, timeout_s=180)
    for res in results:
        assert res["error"] is not None and "shard of a head layer nn.Linear(24, 10)" in res["error"], res["error"]
        assert "Call the model" in res["error"]

"""Turning a model into the hybrid one: data-parallel trunk, model-parallel head (section 4), plus the trunk's
gradient averaging (section 4.1)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_hpc.hybrid_fc.collectives import ByteCounter, allreduce_ring_bytes
from lightning_hpc.hybrid_fc.discovery import ELEMENTWISE, HeadSpec, find_head
from lightning_hpc.hybrid_fc.head import HybridHead

__all__ = ["parallelize_head", "find_hybrid_head", "head_parameters", "trunk_parameters", "average_trunk_gradients"]


class _TrunkThenHead(nn.Module):
    """Replaces an ``nn.Sequential`` whose last children are the head: runs the trunk children, then the hybrid
    head.  Trunk children and the head's shards keep their original names, so ``state_dict`` keys are unchanged."""

    def __init__(self, seq: nn.Sequential, start: int, head: HybridHead) -> None:
        super().__init__()
        names = list(seq._modules)
        self._trunk_names = names[:start]
        for n in self._trunk_names:
            self.add_module(n, seq._modules[n])
        for n, m in head.named_children():
            self.add_module(n, m)
        object.__setattr__(self, "hybrid_head", head)  # not registered twice: its children already are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n in self._trunk_names:
            x = self._modules[n](x)  # type: ignore[misc]
        return self.hybrid_head(x)

    def train(self, mode: bool = True) -> "_TrunkThenHead":
        super().train(mode)
        self.hybrid_head.training = mode
        return self


def _broadcast_head(spec: HeadSpec, group: Any) -> None:
    """Make the full head identical on every rank (rank 0's) before each rank keeps its shard."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for _, m in spec.modules:
        for p in m.parameters():
            dist.broadcast(p.data, src=src, group=group)


def parallelize_head(
    model: nn.Module,
    head: str | None = None,
    scheme: str = "c",
    fc_update: str = "per_step",
    group: Any = None,
    counter: ByteCounter | None = None,
    layouts: Sequence[str] | None = None,
) -> nn.Module:
    """Replace ``model``'s fully-connected head by a :class:`HybridHead` sharded over the ranks of ``group``.

    Returns the model (a new root module only when the model itself is the ``nn.Sequential`` holding the head).
    Every rank must call this with an identically structured model; rank 0's head weights are used.
    """
    spec = find_head(model, head)
    _broadcast_head(spec, group)
    before, linears, between = [], [], []
    for _, m in spec.modules:
        if isinstance(m, nn.Linear):
            linears.append(m)
            between.append([])
        elif isinstance(m, ELEMENTWISE):
            (between[-1] if linears else before).append(m)
    names = {i: n for i, (n, _) in enumerate(spec.modules)}
    hybrid = HybridHead(linears, between, before, names, scheme=scheme, fc_update=fc_update, group=group, counter=counter, layouts=layouts)
    if spec.whole_parent:
        if not spec.parent_name:
            raise ValueError("the whole model is the head; there is no trunk to run data-parallel")
        parent_name, _, attr = spec.parent_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, hybrid)
        return model
    replacement = _TrunkThenHead(spec.parent, spec.start, hybrid)
    if not spec.parent_name:
        return replacement
    parent_name, _, attr = spec.parent_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
    return model


def find_hybrid_head(model: nn.Module) -> HybridHead:
    """The :class:`HybridHead` inside ``model`` (raises if the model was not parallelised)."""
    for m in model.modules():
        if isinstance(m, HybridHead):
            return m
        if isinstance(m, _TrunkThenHead):
            return m.hybrid_head
    raise ValueError("the model has no hybrid head; call parallelize_head(model) first")


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for s in find_hybrid_head(model).shards for p in s.parameters()]


def trunk_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    head = {id(p) for p in head_parameters(model)}
    return (p for p in model.parameters() if id(p) not in head)


@torch.no_grad()
def average_trunk_gradients(model: nn.Module, group: Any = None, counter: ByteCounter | None = None) -> None:
    """Section 4.1: average the replicated trunk's gradients over the ranks (one flat all-reduce per dtype).

    (The Lightning strategy lets DistributedDataParallel do this, with the head's shards excluded.)"""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    k = dist.get_world_size(group)
    grads = [p.grad for p in trunk_parameters(model) if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = _flatten_dense_tensors(gs)
        if counter is not None:
            counter.add("all_reduce", allreduce_ring_bytes(flat.numel(), flat.element_size(), k))
        dist.all_reduce(flat, group=group)
        flat /= k
        for g, f in zip(gs, _unflatten_dense_tensors(flat, gs)):
            g.copy_(f)

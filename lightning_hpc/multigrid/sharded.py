"""A residual trunk whose steps are partitioned over the ranks of a layer-parallel group, memory included.

Rank r of P keeps only its contiguous share of the N steps (paper section III-D: "the layer blocks are
distributed into contiguous model partitions across GPUs"), under the steps' original names ("8", "9", ... on
rank 1 of 2 with N = 16), so its parameters, their gradients and an optimizer built from ``parameters()`` are
1/P of the trunk's.  The multigrid hierarchy needs nothing else: a rank's share starts at a multiple of
c^(levels-1) (partition.py), so every coarse step it evaluates uses the weights of one of its own C-layers
(Eq. 25).  Only the optional gathered coarsest solve (coarse.py) exchanges weights, those of the coarsest
C-layers, at each solve.

State dicts: :meth:`full_state_dict` gathers the whole trunk (collective), with the keys of the serial
``nn.Sequential``, so a checkpoint loads into any number of ranks or into the plain model; loading takes the
local steps' entries of a full state dict and ignores the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.state import gather_keyed_tensors
from lightning_hpc.models.ode_resnet import ResidualStep, residual_steps
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.partition import LayerPartition

__all__ = ["LayerShardedTrunk", "full_model_state_dict"]


class LayerShardedTrunk(nn.Sequential):
    """The local steps of a trunk of residual steps split over ``group`` (``None``: one process, all steps)."""

    def __init__(self, steps: nn.Module, group: dist.ProcessGroup | None, cfactor: int, levels: int) -> None:
        blocks = residual_steps(steps)
        names = (
            [name for name, _ in steps.named_children()]
            if isinstance(steps, nn.Sequential)
            else [str(i) for i in range(len(blocks))]
        )
        super().__init__()
        self.group = group
        self.chain = LayerChain(group)
        self.partition = LayerPartition(len(blocks), self.chain.size, self.chain.index, cfactor, levels)
        self.num_steps = len(blocks)
        self.step_names = names
        part = self.partition
        for name, block in zip(names[part.start : part.stop], blocks[part.start : part.stop]):
            self.add_module(name, block)  # the other ranks' steps are not kept: their memory is theirs
        self.train(steps.training)  # a fresh module defaults to training mode; keep the trunk's

    @property
    def local_blocks(self) -> list[ResidualStep]:
        return list(self)  # type: ignore[arg-type]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A full (serial or gathered) state dict holds every step: keep this rank's, drop the others' so that
        # strict loading neither reports them as unexpected nor loads them anywhere.
        local = set(self._modules)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            step = key[len(prefix) :].split(".", 1)[0]
            if step in self.step_names and step not in local:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args)

    def full_state_dict(self, prefix: str = "", dst: int | None = None) -> OrderedDict[str, torch.Tensor]:
        """State dict of the whole trunk (every step's parameters and buffers) in step order; collective over
        the layer group.  With ``dst`` (a global rank) only that rank gets the full dict."""
        return gather_keyed_tensors(self.state_dict(prefix=prefix), self.group if self.chain.size > 1 else None, dst)


def full_model_state_dict(model: nn.Module, dst: int | None = None) -> OrderedDict[str, torch.Tensor]:
    """``model.state_dict()`` with every :class:`LayerShardedTrunk` inside gathered to its full set of steps,
    in the serial model's key order (collective: every rank of the layer groups calls it)."""
    local = model.state_dict()
    trunks = [(name + "." if name else "", m) for name, m in model.named_modules() if isinstance(m, LayerShardedTrunk)]
    if not trunks:
        return OrderedDict(local)
    full = {prefix: m.full_state_dict(prefix, dst) for prefix, m in trunks}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in local.items():
        prefix = next((p for p, _ in trunks if key.startswith(p)), None)  # "" (the model is the trunk) matches all
        if prefix is None:
            out[key] = value
        elif prefix in full:
            out.update(full.pop(prefix))  # the whole trunk at the place of its first local key
    for rest in full.values():  # a trunk without tensors (parameter-free steps)
        out.update(rest)
    return out

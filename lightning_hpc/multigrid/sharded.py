"""A residual trunk whose steps are partitioned over the ranks of a layer-parallel group, memory included.

Rank r of P keeps only its contiguous share of the N steps (paper section III-D: "the layer blocks are
distributed into contiguous model partitions across GPUs"), under the steps' original names ("8", "9", ... on
rank 1 of 2 with N = 16), so its parameters, their gradients and an optimizer built from ``parameters()`` are
1/P of the trunk's.  The multigrid hierarchy needs nothing else: a rank's share starts at a multiple of
c^(levels-1) (partition.py), so every coarse step it evaluates uses the weights of one of its own C-layers
(Eq. 25).  Only the optional gathered coarsest solve (coarse.py) exchanges weights, those of the coarsest
C-layers, at each solve.

Parameters as user code sees them: with P > 1 ranks, the local steps' parameters are blocks
(:class:`lightning_hpc.distributed.partitioned.BlockTensor`) of a tensor partitioned over the layer group, the
tensor that stacks the same parameter of the step at the same place in every rank's share (step i of rank 0 with
step N/P + i of rank 1, ...).  A reduction over all of a parameter's (or its gradient's) elements is that
tensor's, so a sum over ``self.parameters()`` of such reductions (a gradient norm logged in
``on_before_optimizer_step``, Lightning's ``grad_norm`` total, an L2 penalty in the loss) covers every step once,
as on one process; a single step's value read alone is that of its place in all the shares (so Lightning's
per-parameter ``grad_norm`` is refused, naming :func:`lightning_hpc.multigrid.grad_norms.grad_norm`, which gives
every step's own entry).  Every rank's share must
then hold the same parameters in the same order (checked at construction: the reductions are collectives).

State dicts: :meth:`full_state_dict` gathers the whole trunk (collective), with the keys of the serial
``nn.Sequential``, so a checkpoint loads into any number of ranks or into the plain model; loading takes the
local steps' entries of a full state dict and ignores the others.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.partitioned import STACKED, as_block_parameter, local_block
from lightning_hpc.distributed.state import gather_keyed_tensors
from lightning_hpc.models.ode_resnet import ResidualStep
from lightning_hpc.multigrid.ode_form import residual_steps
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.partition import LayerPartition

__all__ = ["LayerShardedTrunk", "full_model_state_dict", "release_other_steps", "restore_trunk"]


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
        if self.chain.size > 1:
            refuse_shared_parameters(blocks, names)
        self.partition = LayerPartition(len(blocks), self.chain.size, self.chain.index, cfactor, levels)
        self._cfactor, self._levels = cfactor, levels
        self.num_steps = len(blocks)
        self.step_names = names
        part = self.partition
        for name, block in zip(names[part.start : part.stop], blocks[part.start : part.stop]):
            self.add_module(name, block)  # the other ranks' steps are not kept: their memory is theirs
        self.train(steps.training)  # a fresh module defaults to training mode; keep the trunk's
        if self.chain.size > 1:
            self._partition_parameters()

    def _partition_parameters(self) -> None:
        """Make the local steps' parameters blocks over the layer group (see the module's docstring)."""
        positions = [
            (i, name, tuple(p.shape), p.dtype) for i, block in enumerate(self) for name, p in block.named_parameters()
        ]
        shares: list[Any] = [None] * self.chain.size
        dist.all_gather_object(shares, positions, group=self.group)
        if any(share != positions for share in shares):
            first = next(r for r, share in enumerate(shares) if share != shares[0])
            raise ValueError(
                "the layer-sharded trunk's ranks hold steps with different parameters (rank "
                f"{self.chain.ranks[0]}'s share: {len(shares[0])} parameters, rank {self.chain.ranks[first]}'s: "
                f"{len(shares[first])}, or other names / shapes): a reduction over the model's parameters is one "
                "collective per parameter and needs every share alike; give every residual step the same layers, "
                "or train the trunk with layer_parallel_size=1"
            )
        for block in self:
            for module in block.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    setattr(module, name, as_block_parameter(p, self.group, dim=STACKED))

    @property
    def local_blocks(self) -> list[ResidualStep]:
        return list(self)  # type: ignore[arg-type]

    # Indexing reads as the user's nn.Sequential of every step (as on one process): index i is step i of the
    # whole trunk, wherever it lives.  Positional indexing of this rank's share would silently give rank 1's
    # first step for ``trunk[0]``; a step another rank holds is refused by name instead.  Iteration (``for step
    # in trunk``, ``children()``) goes over this rank's own steps, as ``parameters()`` does.
    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, idx: int | slice) -> nn.Module:  # type: ignore[override]
        if isinstance(idx, slice):
            indices = range(self.num_steps)[idx]
            for i in indices:
                self._local_step(i)  # refused if another rank holds it
            return nn.Sequential(OrderedDict((self.step_names[i], self._local_step(i)) for i in indices))
        index = operator.index(idx)
        if not -self.num_steps <= index < self.num_steps:
            raise IndexError(f"index {index} is out of range: the trunk has {self.num_steps} residual steps")
        return self._local_step(index % self.num_steps)

    def share(self, rank: int) -> LayerPartition:
        """The steps layer rank ``rank`` holds (a partition is a function of the sizes alone)."""
        if rank == self.chain.index:
            return self.partition
        return LayerPartition(self.num_steps, self.chain.size, rank, self._cfactor, self._levels)

    def _local_step(self, index: int) -> nn.Module:
        part = self.partition
        if part.start <= index < part.stop:
            return self._modules[self.step_names[index]]  # type: ignore[return-value]
        holder = next(r for r in range(self.chain.size) if self.share(r).start <= index < self.share(r).stop)
        raise IndexError(
            f"residual step {index} ('{self.step_names[index]}') of the trunk is held by layer rank {holder}: the "
            f"trunk's {self.num_steps} steps are split over {self.chain.size} ranks (strategy='multigrid'), and "
            f"this rank (layer rank {self.chain.index}) holds steps {part.start}..{part.stop - 1}. Reach a step on "
            "the rank that holds it (trunk.partition.start / .stop), or after the stage, when the whole trunk is "
            "handed back on every rank; reductions over all of self.parameters() already cover every step"
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A full (serial or gathered) state dict holds every step: keep this rank's, drop the others' so that
        # strict loading neither reports them as unexpected nor loads them anywhere.
        local = set(self._modules)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            step = key[len(prefix) :].split(".", 1)[0]
            if step in self.step_names and step not in local:
                del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args)

    def full_state_dict(self, prefix: str = "", dst: int | None = None,
                        device: torch.device | None = None) -> OrderedDict[str, torch.Tensor]:
        """State dict of the whole trunk (every step's parameters and buffers) in step order; collective over
        the layer group.  With ``dst`` (a global rank) only that rank gets the full dict.  ``device``: where the
        tensors travel when the trunk is kept elsewhere (a weight-averaging copy on the host beside a GPU model:
        NCCL moves device tensors only); what is received is put where the trunk is."""
        group = self.group if self.chain.size > 1 else None
        return gather_keyed_tensors(self.state_dict(prefix=prefix), group, dst, device=device)


def release_other_steps(sharded: LayerShardedTrunk, trunk: nn.Module) -> None:
    """Move the steps of the user's ``trunk`` that ``sharded`` does not hold (other ranks' steps) to the meta
    device: their memory is freed, their modules (types, shapes, names) stay for :func:`restore_trunk`."""
    for name, step in trunk.named_children():
        if name in sharded.step_names and name not in sharded._modules:
            step.to("meta")


def restore_trunk(sharded: LayerShardedTrunk, trunk: nn.Module) -> dict[int, nn.Parameter]:
    """The user's ``trunk`` (the module ``sharded`` was built from) filled with every step's trained parameters
    and buffers, gathered from the layer group onto every rank (collective), as plain tensors: the trunk runs on
    one rank alone, and its state loads strictly into the user's model.  Returns, for rebinding an optimizer,
    each of ``sharded``'s parameters' replacement by ``id`` (empty on one process: the trunk holds the very
    steps ``sharded`` trained)."""
    if sharded.chain.size == 1:
        return {}
    full = sharded.full_state_dict()
    trunk.load_state_dict(OrderedDict((k, local_block(v)) for k, v in full.items()), strict=True, assign=True)
    new = dict(trunk.named_parameters())
    return {id(p): new[name] for name, p in sharded.named_parameters()}


def refuse_shared_parameters(blocks: list[ResidualStep], names: list[str]) -> None:
    """Steps split over ranks must not share a parameter (one residual branch reused by every step, neural-ODE
    style): each rank would hold its own copy, its gradient from that rank's steps only, and the copies would
    drift apart.  Raised at construction, before any optimizer step, naming the steps and the fix."""
    owner: dict[int, tuple[str, str]] = {}
    for step, block in zip(names, blocks):
        for pname, p in block.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (step, pname))
            if first[0] != step:
                raise ValueError(
                    f"steps {first[0]!r} and {step!r} of the trunk share one parameter ({first[0]}.{first[1]} is "
                    f"{step}.{pname}): split over the layer-parallel ranks, each rank would train its own copy from "
                    "its own steps and the copies would drift apart. Give every step its own branch (e.g. "
                    "copy.deepcopy of the shared one: a different model, each step's weights then train apart), or "
                    "keep the trunk whole: layer_parallel_size=1 (data parallel over all ranks) or strategy='ddp'"
                )


def full_model_state_dict(model: nn.Module, dst: int | None = None,
                          device: torch.device | None = None) -> OrderedDict[str, torch.Tensor]:
    """``model.state_dict()`` with every :class:`LayerShardedTrunk` inside gathered to its full set of steps,
    in the serial model's key order (collective: every rank of the layer groups calls it; ``device``: where the
    trunks' tensors travel, :meth:`LayerShardedTrunk.full_state_dict`)."""
    local = model.state_dict()
    trunks = [(name + "." if name else "", m) for name, m in model.named_modules() if isinstance(m, LayerShardedTrunk)]
    if not trunks:
        return OrderedDict(local)
    full = {prefix: m.full_state_dict(prefix, dst, device) for prefix, m in trunks}
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

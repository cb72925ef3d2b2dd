"""Full (unsharded) checkpoints of a model with a hybrid head, loadable on any number of ranks.

Saving gathers every shard (and every optimizer state tensor shaped like a shard: momentum, Adam moments) into the
full tensor under the unsharded model's key; loading slices full tensors back into this rank's shard
(``ShardedLinear._load_from_state_dict`` for the weights, :func:`shard_optimizer_state` for the optimizer).  A
full checkpoint therefore loads into K' ranks for any K', or into the plain single-device model.

Memory of saving.  ``rank0_only=False`` all-gathers: every rank ends with the full head (fine for small heads and
tests).  ``rank0_only=True, cpu=True`` (what :class:`HybridParallelStrategy` uses) gathers one tensor at a time to
rank 0 and moves it to host memory at once: on rank 0 the device holds its shards plus, transiently, about two
copies of the largest single head tensor (K padded blocks and the concatenation); the host holds the full
checkpoint; every other rank holds only its shards plus one padded block.  So a head that does not fit one
device's memory is saved as long as its largest layer fits twice and the whole model fits rank 0's host memory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear

__all__ = ["full_state_dict", "full_optimizer_state", "shard_optimizer_state"]


def _shards(module: nn.Module) -> list[tuple[str, ShardedLinear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ShardedLinear)]


def _head_comm(module: nn.Module) -> Any:
    from lightning_hpc.hybrid_fc.parallel import find_hybrid_head

    return find_hybrid_head(module).comm


def _gather(comm: Any, shard: ShardedLinear, name: str, value: torch.Tensor, rank0_only: bool, cpu: bool) -> torch.Tensor:
    """Full tensor of a shard-shaped ``value``; with ``rank0_only`` only group rank 0 gets it (others keep
    ``value``)."""
    sizes, dim = shard.shard_sizes(name)
    value = value.detach().contiguous()
    if rank0_only:
        full = comm.gather(value, sizes, dim=dim, dst=0, count=False)
        if full is None:
            return value
    else:
        full = comm.all_gather(value, sizes, dim=dim).clone()
    return full.cpu() if cpu else full


def full_state_dict(module: nn.Module, prefix: str = "", rank0_only: bool = False, cpu: bool = False) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every head shard replaced by the full tensor (collective: call on all ranks).

    ``rank0_only``: gather to group rank 0 only, one tensor at a time (the other ranks' dict keeps the shards);
    ``cpu``: move each gathered tensor to host memory right away (see the module docstring for the peaks)."""
    state = module.state_dict(prefix=prefix)
    comm = _head_comm(module)
    for name, shard in _shards(module):
        for pname in ("weight", "bias"):
            key = f"{prefix}{name}.{pname}"
            if key in state:
                state[key] = _gather(comm, shard, pname, state[key], rank0_only, cpu)
    return state


def _param_index(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[int, tuple[ShardedLinear, str]]:
    """Optimizer state index -> (shard, parameter name) for the head's shards."""
    owner = {id(getattr(s, p)): (s, p) for _, s in _shards(module) for p in ("weight", "bias") if getattr(s, p) is not None}
    out, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in owner:
                out[i] = owner[id(p)]
            i += 1
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, rank0_only: bool = False, cpu: bool = False) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the head shards' state tensors gathered to full shape (collective;
    ``rank0_only``/``cpu`` as in :func:`full_state_dict`)."""
    sd = optimizer.state_dict()
    comm = _head_comm(module)
    index = _param_index(optimizer, module)
    state = dict(sd["state"])
    for i, (shard, pname) in sorted(index.items()):
        entry = dict(state.get(i, {}))
        shard_shape = tuple(getattr(shard, pname).shape)
        for key, value in sorted(entry.items()):
            if torch.is_tensor(value) and tuple(value.shape) == shard_shape:
                entry[key] = _gather(comm, shard, pname, value, rank0_only, cpu)
        state[i] = entry
    return {**sd, "state": state}


def shard_optimizer_state(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """Inverse of :func:`full_optimizer_state`: slice full-shape state tensors to this rank's shards."""
    sd = copy.copy(state_dict)
    state = dict(sd["state"])
    for i, (shard, pname) in _param_index(optimizer, module).items():
        if i not in state:
            continue
        entry = dict(state[i])
        full = shard.full_shape(pname)
        for key, value in entry.items():
            if torch.is_tensor(value) and tuple(value.shape) == full:
                entry[key] = shard.slice_full(pname, value).clone()
        state[i] = entry
    sd["state"] = state
    return sd

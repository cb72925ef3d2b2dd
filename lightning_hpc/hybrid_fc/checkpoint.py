"""Full (unsharded) checkpoints of a model with a hybrid head, loadable on any number of ranks.

Saving gathers every shard (and every optimizer state tensor shaped like a shard: momentum, Adam moments) into the
full tensor under the unsharded model's key; loading slices full tensors back into this rank's shard
(``ShardedLinear._load_from_state_dict`` for the weights, :func:`shard_optimizer_state` for the optimizer).  A
full checkpoint therefore loads into K' ranks for any K', or into the plain single-device model.  This module
knows which tensors are shards and along which dimension; the transport is the shared one,
:func:`lightning_hpc.distributed.state.gather_keyed_tensors` (shards are its *split* keys).

Memory of saving.  ``rank0_only=False`` gathers to every rank: every rank ends with the full head (fine for small
heads and tests).  ``rank0_only=True, cpu=True`` (what :class:`HybridParallelStrategy` uses) sends every rank's
shards to rank 0 in flat buckets of at most ``DEFAULT_BUCKET_BYTES`` (32 MiB; a larger shard travels alone), one
bucket at a time, each received shard moved to host memory at once: on rank 0 the device holds its shards plus,
transiently, one bucket; the host holds the full checkpoint plus, while it concatenates, one more copy of one full
tensor; every other rank holds its shards plus the bucket it is sending.  So a head that does not fit one
device's memory is saved as long as one bucket (or the largest shard) fits beside the shards and the whole model
fits rank 0's host memory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_hpc.distributed.state import take_slice
from lightning_hpc.distributed.whole_flat import keeps_global_state
from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear, gather_shard_tensors

__all__ = ["full_state_dict", "full_optimizer_state", "shard_optimizer_state"]


def _shards(module: nn.Module) -> list[tuple[str, ShardedLinear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ShardedLinear)]


def _head_group(module: nn.Module) -> Any:
    from lightning_hpc.hybrid_fc.parallel import find_hybrid_head

    return find_hybrid_head(module).comm.group


def _gather(module: nn.Module, shards: dict[str, tuple[ShardedLinear, str, torch.Tensor]], rank0_only: bool,
            cpu: bool, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    return gather_shard_tensors(shards, _head_group(module), rank0_only, cpu, device)


def full_state_dict(
    module: nn.Module, prefix: str = "", rank0_only: bool = False, cpu: bool = False,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every head shard replaced by the full tensor (collective: call on all ranks).

    ``rank0_only``: gather to group rank 0 only (the other ranks' dict keeps the shards); ``cpu``: move each
    gathered tensor to host memory as it arrives (see the module docstring for the peaks); ``device``: the device
    the head's collectives run on, for a module kept elsewhere (:func:`gather_shard_tensors`)."""
    state = module.state_dict(prefix=prefix)
    shards = {f"{prefix}{name}.{pname}": (shard, pname, state[f"{prefix}{name}.{pname}"])
              for name, shard in _shards(module) for pname in shard.param_names if f"{prefix}{name}.{pname}" in state}
    state.update(_gather(module, shards, rank0_only, cpu, device))
    return state


def _param_index(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[int, tuple[ShardedLinear, str]]:
    """Optimizer state index -> (shard, parameter name) for the head's shards whose state is theirs (none for an
    optimizer whose one state is the whole model's, LBFGS's flat vectors: equal on every rank, kept as they are)."""
    if keeps_global_state(optimizer):
        return {}
    owner = {id(s.get_parameter(p)): (s, p) for _, s in _shards(module) for p in s.param_names}
    out, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in owner:
                out[i] = owner[id(p)]
            i += 1
    return out


def full_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, rank0_only: bool = False, cpu: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with the head shards' state tensors gathered to full shape (collective;
    ``rank0_only``/``cpu`` as in :func:`full_state_dict`)."""
    sd = optimizer.state_dict()
    index = _param_index(optimizer, module)
    state = dict(sd["state"])
    shards: dict[str, tuple[ShardedLinear, str, torch.Tensor]] = {}
    for i, (shard, pname) in sorted(index.items()):
        shard_shape = tuple(shard.get_parameter(pname).shape)
        for key, value in sorted(state.get(i, {}).items()):
            if torch.is_tensor(value) and tuple(value.shape) == shard_shape:
                shards[f"{i}/{key}"] = (shard, pname, value)
    for skey, value in _gather(module, shards, rank0_only, cpu).items():
        index_text, key = skey.split("/", 1)
        state[int(index_text)] = {**state[int(index_text)], key: value}
    return {**sd, "state": state}


def shard_optimizer_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module
) -> dict[str, Any]:
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
                sizes, dim = shard.shard_sizes(pname)
                entry[key] = take_slice(value, dim, sizes, shard.rank)
        state[i] = entry
    sd["state"] = state
    return sd

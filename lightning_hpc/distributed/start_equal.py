"""Every rank starts from the same state: rank ``src``'s parameters and buffers, as DistributedDataParallel does
at construction.

Strategies that do not wrap the model in DDP (layered SGD, spatial, multigrid) need this once per fit, and a
replica that starts elsewhere trains to different weights with nothing to show for it.  One flat buffer per
dtype travels (as DDP's own ``_sync_module_states`` buckets it), over any :class:`~lightning_hpc.distributed.
comm.Communicator` (torch.distributed or Horovod), so the number of messages does not grow with the number of
tensors.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch

from lightning_hpc._compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator

__all__ = ["start_equal", "module_state_tensors", "generator_states", "set_generator_states",
           "start_equal_generators"]


def module_state_tensors(module: torch.nn.Module, *, parameters: bool = True, buffers: bool = True,
                         skip: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The parameters and/or buffers of ``module`` (each once, shared ones too), minus ``skip`` (tensors that
    are meant to differ between ranks, e.g. the shards of a model-parallel layer)."""
    skipped = {id(t) for t in skip}
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in [*(module.parameters() if parameters else ()), *(module.buffers() if buffers else ())]:
        if id(t) not in seen and id(t) not in skipped:
            seen.add(id(t))
            out.append(t)
    return out


@torch.no_grad()
def start_equal(
    tensors: Iterable[torch.Tensor], comm: Communicator | None = None, src: int = 0, group: object = None
) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values (collective: every rank of ``group`` calls it
    with tensors of the same shapes and dtypes, in the same order).  ``comm`` defaults to torch.distributed."""
    tensors = list(tensors)
    comm = comm or TorchDistributedCommunicator()
    if comm.group_size(group) == 1 or not tensors:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = flatten_dense_tensors([t.data for t in same])
        comm.broadcast(flat, src=src, group=group)
        for t, value in zip(same, unflatten_dense_tensors(flat, [t.data for t in same])):
            t.data.copy_(value)


def generator_states() -> dict[str, Any]:
    """The global generators' states: torch's CPU generator, every visible GPU's, Python's ``random`` and NumPy's
    (those ``seed_everything`` seeds).  Reading them draws nothing."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        states["numpy"] = np.random.get_state()
    return states


def set_generator_states(states: dict[str, Any]) -> None:
    """Put back what :func:`generator_states` read."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])


def start_equal_generators(device: torch.device, comm: Communicator | None = None, src: int = 0,
                           group: object = None) -> None:
    """Set torch's CPU generator, and ``device``'s where it is a GPU, to rank ``src``'s states (collective).

    The generators a model's random ops draw from (dropout masks, ``rand_like``) then agree on every rank however
    each process was started or seeded; where the ranks were seeded alike they agreed already and nothing changes.
    The states travel on ``device`` (NCCL moves no CPU tensor)."""
    cuda = device.type == "cuda"
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if cuda else [])
    moved = [t.to(device) for t in states]
    start_equal(moved, comm, src, group)
    torch.set_rng_state(moved[0].cpu())
    if cuda:
        torch.cuda.set_rng_state(moved[1].cpu(), device)

"""The user's model back after a run: a model-parallel strategy (hybrid_fc's sharded head, multigrid's
layer-sharded trunk) splits the user's module while ``fit`` / ``validate`` / ``test`` / ``predict`` runs, and
hands it back, whole, when the run ends.

Handing back gathers every rank's part (a collective), so it happens only where every rank arrives in the same
order: the strategy's ``teardown`` at the end of a stage that ended normally.  After a failure or a SIGTERM
the peers may be gone, so the model is left split there (a gather would wait for ranks that never come).

The optimizers Lightning built for the split model are rebound to the whole parameters, their state gathered
to the whole tensors, so what stays after ``fit`` is what one process (or DDP) leaves: the user's module with
whole parameters and an optimizer over them, on every rank; a checkpoint written after ``fit``
(``trainer.save_checkpoint``) needs no collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpc.distributed.partitioned import local_block

__all__ = ["ended_normally", "fitting", "follow_parameters", "rebind_optimizer"]


def ended_normally(module: Any) -> bool:
    """Whether the LightningModule ``module``'s trainer is tearing down a stage that ran to its end on this rank
    (Lightning sets ``INTERRUPTED`` before its teardown after an exception or a SIGTERM), so every rank of the
    run reaches the same teardown and a collective there meets its peers."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return False
    # TrainerStatus is a str enum: compared by value, so this core module does not import Lightning
    return trainer.state.status == "running" and not getattr(trainer, "received_sigterm", False)


def fitting(module: Any) -> bool:
    """Whether the stage ``module``'s trainer tears down is ``fit``: the one whose optimizers are over the split model
    (another stage steps nothing; its optimizers, if any, are an earlier fit's, over the model it handed back)."""
    trainer = getattr(module, "_trainer", None)
    # TrainerFn is a str enum: compared by value, as ended_normally compares the status
    return trainer is not None and trainer.state.fn == "fit"


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, params: Sequence[Sequence[nn.Parameter]], state: Mapping[str, Any]
) -> None:
    """Point ``optimizer``'s param groups at ``params`` (one list per group, in the order of ``state``'s groups)
    and load ``state``, a ``state_dict`` of the optimizer over those parameters (the whole model's, gathered by
    the strategy).  The optimizer object stays the same, so schedulers and Lightning's references to it hold."""
    if len(params) != len(optimizer.param_groups):
        raise ValueError(f"{len(params)} parameter lists for {len(optimizer.param_groups)} param groups")
    for group, group_params in zip(optimizer.param_groups, params):
        group["params"] = list(group_params)
    optimizer.state.clear()  # keyed by the split parameters, which the model no longer holds
    # plain tensors: a momentum buffer of a block parameter is a block, whose reductions would be collectives
    plain = {i: {k: local_block(v) if torch.is_tensor(v) else v for k, v in entry.items()}
             for i, entry in state["state"].items()}
    optimizer.load_state_dict({**state, "state": plain})


def follow_parameters(optimizer: torch.optim.Optimizer, names: Mapping[int, str], module: nn.Module) -> None:
    """Replace, in ``optimizer``'s param groups and state, each parameter that ``names`` names (by ``id``: the
    parameters of ``module`` before a stage split it) by ``module``'s parameter of that name now, keeping its
    state: the optimizer of an earlier fit follows the module when a later stage hands it back."""
    now = dict(module.named_parameters())
    for group in optimizer.param_groups:
        for j, p in enumerate(group["params"]):
            new = now.get(names.get(id(p), ""))
            if new is None or new is p:
                continue
            group["params"][j] = new
            if p in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(p)

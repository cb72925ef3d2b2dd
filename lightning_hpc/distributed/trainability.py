"""Parameters that change trainability (``requires_grad``) during a run.

A gradient reduction is built for the parameters that are trainable when it is built: DDP's reducer and
Horovod's ``DistributedOptimizer`` register their hooks once.  A parameter unfrozen later (Lightning's
``BackboneFinetuning``, a user's callback) is then never reduced, so the ranks drift apart; one frozen later
leaves its bucket unreduced (DDP) or gets a zero gradient that momentum and weight decay still apply (Horovod).
:class:`TrainableSet` records the set a reduction was built for, so a strategy can either follow a change
(layered SGD rebuilds its buckets) or refuse it before the optimizer step that would be wrong.

Plain torch; callbacks act on every rank alike (``BackboneFinetuning`` unfreezes at the same epoch everywhere),
so every rank refuses at the same step.
"""

from __future__ import annotations

import torch

__all__ = ["REBUILD_FIX", "TrainabilityChanged", "TrainableSet"]


class TrainabilityChanged(RuntimeError):
    """Parameters became trainable or frozen after the gradient reduction was built for the others."""


class TrainableSet:
    """The parameters of ``module`` that are trainable now (``requires_grad=True``), to compare later."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.ids = self.current_ids(module)

    @staticmethod
    def current_ids(module: torch.nn.Module) -> frozenset[int]:
        return frozenset(id(p) for p in module.parameters() if p.requires_grad)

    def changed(self, module: torch.nn.Module) -> bool:
        """Whether the trainable parameters differ from the recorded ones (cheap: one pass, no names)."""
        return self.current_ids(module) != self.ids

    def changes(self, module: torch.nn.Module) -> tuple[list[str], list[str]]:
        """Names of the parameters that became trainable, and of those that became frozen, since recorded."""
        now = self.current_ids(module)
        gained = [n for n, p in module.named_parameters() if id(p) in now and id(p) not in self.ids]
        lost = [n for n, p in module.named_parameters() if id(p) in self.ids and id(p) not in now]
        return gained, lost

    def refuse_changes(self, module: torch.nn.Module, strategy: str, fix: str) -> None:
        """Raise :class:`TrainabilityChanged` naming the parameters when the trainable set changed (call it before
        the optimizer step: nothing has been applied yet)."""
        if not self.changed(module):
            return
        gained, lost = self.changes(module)
        what = []
        if gained:
            what.append(f"became trainable: {gained[:5]}{' ...' if len(gained) > 5 else ''}")
        if lost:
            what.append(f"were frozen: {lost[:5]}{' ...' if len(lost) > 5 else ''}")
        raise TrainabilityChanged(
            f"{strategy}: parameters of {type(module).__name__} {'; '.join(what)} after the gradient reduction was "
            "built for the parameters trainable at the start of fit (e.g. BackboneFinetuning, or a callback setting "
            "requires_grad); this step would apply gradients that were not averaged over the ranks, so it is "
            f"refused before it is taken. {fix}"
        )


#: the fix every strategy that cannot follow a change names (the reduction is rebuilt by each ``trainer.fit``)
REBUILD_FIX = (
    "Change requires_grad between two trainer.fit calls (each fit rebuilds the reduction: e.g. fit the frozen "
    "phase, then fit again after unfreezing), keep the parameters trainable with lr=0 in their own parameter group "
    "until they should train, or use strategy='layered_sgd', which reduces a parameter from the step its "
    "trainability changes."
)

"""The head's optimizer for fc_update="per_subbatch" (section 4.2) and its sharded state."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["HeadOptimizer"]


class HeadOptimizer:
    """Steps only the head's shards, sharing hyper-parameters and state with the main optimizer.

    The main optimizer (e.g. the one Lightning's ``configure_optimizers`` built) keeps all parameters, so its
    ``state_dict`` holds the head's momentum too; this object builds an optimizer of the same class over the
    head's shards that *shares* ``state`` with it, copies each group's current hyper-parameters (a scheduler may
    have changed the learning rate) before every step, and clears the shards' gradients after it, so the main
    optimizer's end-of-step ``step()`` skips them (optimizers skip parameters whose ``grad`` is ``None``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, head_params: Iterable[nn.Parameter]) -> None:
        head = {id(p) for p in head_params}
        self.main = optimizer
        groups, self._group_map = [], []
        for gi, group in enumerate(optimizer.param_groups):
            params = [p for p in group["params"] if id(p) in head]
            if params:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
                self._group_map.append(gi)
        if not groups:
            raise ValueError("the optimizer holds none of the head's parameters; build it after parallelize_head")
        self.head = type(optimizer)(groups, **optimizer.defaults)
        self.head.state = optimizer.state  # shared: one momentum buffer per shard, checkpointed by the main one

    def step(self) -> None:
        for hg, gi in zip(self.head.param_groups, self._group_map):
            for k, v in self.main.param_groups[gi].items():
                if k != "params":
                    hg[k] = v
        self.head.step()
        for g in self.head.param_groups:
            for p in g["params"]:
                p.grad = None

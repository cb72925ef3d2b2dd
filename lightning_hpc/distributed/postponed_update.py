"""The postponed parameter update of layered SGD (Yu et al., Algorithm 3, lines 6-10).

After the backward pass of step ``t`` the local gradients are packed into one flat buffer and the hierarchical
reduction is *started* (:meth:`PostponedUpdate.begin`, Algorithm 3 line 6; the inter-group allreduce of line 8
then runs on the communicator thread).  The caller goes on loading mini-batch ``t+1``.  Just before the forward
pass of step ``t+1`` it *completes* the reduction, writes the globally averaged gradients into ``.grad``
(line 9) and applies the update ``w_{t+1} = w_t - eps * dw`` (line 10) with :meth:`PostponedUpdate.apply`.

Because the update uses exactly the gradients and the hyper-parameters step ``t`` would have used, the
parameters seen by every forward pass are those of synchronous SGD (Algorithms 1 and 2; paper Sec. 4.2):

- the optimizer's hyper-parameters (``lr``, ``momentum``, ``weight_decay``, ...) are recorded at ``begin`` and
  put back for the deferred step, so an lr scheduler stepping in between does not leak into step ``t``;
- parameters that received no gradient on *any* rank keep ``grad=None`` (a per-parameter presence count is
  reduced with the gradients), so optimizers skip them as they would in a single process.

Plain torch; the Lightning adapter (``lightning_hpc.strategies.layered_sgd``) only decides *when* to call these.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lightning_hpc.distributed.hierarchical import HierarchicalAllreduce

__all__ = ["PostponedUpdate"]


class PostponedUpdate:
    """Algorithm 3's split of one synchronous SGD step around the next data load."""

    def __init__(self, params: Iterable[torch.nn.Parameter], allreduce: HierarchicalAllreduce) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("PostponedUpdate needs at least one parameter with requires_grad=True")
        self.allreduce = allreduce
        self._hyper: list[list[dict[str, Any]]] | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._buffer: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        """True between :meth:`begin` and the completion of the reduction."""
        return self._buffer is not None

    # ------------------------------------------------------------------ lines 6 and 8
    def begin(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Pack the local gradients and start the hierarchical reduction; record the optimizers' settings."""
        if self._buffer is not None:
            raise RuntimeError("PostponedUpdate.begin called while an update is still pending; call apply() first")
        self._optimizers = list(optimizers)
        self._hyper = [
            [{k: copy.copy(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]
            for opt in self._optimizers
        ]
        self._buffer = self._pack()
        self.allreduce.start(self._buffer)

    # ------------------------------------------------------------------ lines 9 and 10
    def finish_gradients(self) -> bool:
        """Complete the reduction and write the global mean into ``.grad``; False if nothing was pending."""
        if self._buffer is None:
            return False
        buffer = self.allreduce.finish()
        self._buffer = None
        self._unpack(buffer)
        return True

    def apply(self, step: Callable[[], Any]) -> bool:
        """Complete the reduction, then run ``step`` (the optimizer step and everything that reads gradients)
        under the hyper-parameters recorded at :meth:`begin`.  Returns False if nothing was pending."""
        if not self.finish_gradients():
            return False
        with self.recorded_hyperparameters():
            step()
        return True

    @contextlib.contextmanager
    def recorded_hyperparameters(self) -> Iterator[None]:
        """Temporarily give the optimizers the settings they had at :meth:`begin`, then restore the current ones
        (a scheduler may have stepped in between; its new values belong to the next step)."""
        hyper, optimizers = self._hyper, self._optimizers
        if not hyper:
            yield
            return
        current = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
        try:
            for opt, groups in zip(optimizers, hyper):
                for group, saved in zip(opt.param_groups, groups):
                    group.update(saved)
            yield
        finally:
            for opt, groups in zip(optimizers, current):
                for group, now in zip(opt.param_groups, groups):
                    group.update(now)
            self._hyper, self._optimizers = None, []

    # ------------------------------------------------------------------ packing
    def _pack(self) -> torch.Tensor:
        grads = [p.grad for p in self.params]
        present = [g for g in grads if g is not None]
        ref = present[0] if present else self.params[0]
        dtype = ref.dtype
        for g in present:
            dtype = torch.promote_types(dtype, g.dtype)
        n = sum(p.numel() for p in self.params)
        buffer = torch.zeros(n + len(self.params), dtype=dtype, device=ref.device)
        offset = 0
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None:
                buffer[offset : offset + p.numel()].copy_(g.reshape(-1))
                buffer[n + i] = 1.0  # presence count, reduced with the gradients
            offset += p.numel()
        return buffer

    def _unpack(self, buffer: torch.Tensor) -> None:
        n = buffer.numel() - len(self.params)
        present = (buffer[n:] > 0).tolist()  # one host transfer for all flags
        offset = 0
        for i, p in enumerate(self.params):
            k = p.numel()
            if present[i]:
                mean = buffer[offset : offset + k].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
            else:
                p.grad = None
            offset += k

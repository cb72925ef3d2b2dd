"""The postponed parameter update of layered SGD (Yu et al., Algorithm 3, lines 6-10).

During the backward pass of step ``t`` the local gradients are packed into flat *buckets* (reverse parameter
order, as DDP's) and the hierarchical reduction of each bucket is *started* as soon as all of its gradients
have been accumulated (per-parameter ``register_post_accumulate_grad_hook``), so the reduction of the last
layers overlaps the backward pass of the first ones; :meth:`PostponedUpdate.begin`, after the backward pass,
starts whatever is left (Algorithm 3 line 6; the inter-group allreduce of line 8 runs on the communicator
thread).  The caller goes on loading mini-batch ``t+1``.  Just before the forward
pass of step ``t+1`` it *completes* the reduction, writes the globally averaged gradients into ``.grad``
(line 9) and applies the update ``w_{t+1} = w_t - eps * dw`` (line 10) with :meth:`PostponedUpdate.apply`.

Because the update uses exactly the gradients and the hyper-parameters step ``t`` would have used, the
parameters seen by every forward pass are those of synchronous SGD (Algorithms 1 and 2; paper Sec. 4.2):

- the optimizer's hyper-parameters (``lr``, ``momentum``, ``weight_decay``, ...) are recorded at ``begin`` and
  put back for the deferred step, so an lr scheduler stepping in between does not leak into step ``t``;
- parameters that received no gradient on *any* rank keep ``grad=None`` (a per-parameter presence count is
  reduced with the gradients), so optimizers skip them as they would in a single process;
- buckets are started strictly in bucket order on every rank (a bucket waits for all earlier ones), so ranks
  on which some parameter got no gradient still issue the same collectives in the same order;
- gradient accumulation: backward passes of all micro-batches but the last run under :meth:`no_sync` (as with
  DDP), so only the accumulated gradient is reduced.

Plain torch; the Lightning adapter (``lightning_hpc.layered_sgd.strategy``) only decides *when* to call these.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_hpc.layered_sgd.hierarchical import HierarchicalAllreduce

__all__ = ["PostponedUpdate"]


#: DDP's defaults: a small first bucket starts communication early, later buckets amortise per-message costs
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclass
class _Bucket:
    """A flat buffer for some parameters' gradients followed by one presence flag per parameter."""

    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def assign_buckets(
    params: list[torch.nn.Parameter], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets in *reverse* order (gradients become ready roughly from the
    last layer to the first), a bucket closing once it holds ``cap_bytes`` (the first one ``first_cap_bytes``);
    a bucket only holds parameters of one dtype and device (as DDP's ``compute_bucket_assignment_by_size``)."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += p.numel() * p.element_size()
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    buckets.extend(members for members, _ in open_.values())
    return buckets


class PostponedUpdate:
    """Algorithm 3's split of one synchronous SGD step around the next data load.

    Args:
        params: the parameters to train (those with ``requires_grad=False`` are ignored).
        allreduce: the hierarchical reduction (one ``start`` per bucket, one ``finish`` per step).
        bucket_cap_mb: bucket size; ``first_bucket_mb`` for the first (last layers') bucket.
        overlap_backward: start a bucket's reduction from gradient hooks as soon as it is full (default).  With
            ``False`` all buckets are started by :meth:`begin`, after the backward pass.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        allreduce: HierarchicalAllreduce,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
        overlap_backward: bool = True,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("PostponedUpdate needs at least one parameter with requires_grad=True")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb} and first_bucket_mb={first_bucket_mb} must be > 0 (megabytes)"
            )
        self.allreduce = allreduce
        self._hyper: list[list[dict[str, Any]]] | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self.buckets: list[_Bucket] = []
        self._bucket_of: list[int] = [0] * len(self.params)
        for b, members in enumerate(
            assign_buckets(self.params, int(bucket_cap_mb * 2**20), int(first_bucket_mb * 2**20))
        ):
            ps = [self.params[i] for i in members]
            numel = sum(p.numel() for p in ps)
            offsets = [0]
            for p in ps[:-1]:
                offsets.append(offsets[-1] + p.numel())
            buffer = torch.zeros(numel + len(ps), dtype=ps[0].dtype, device=ps[0].device)
            self.buckets.append(_Bucket(ps, buffer, offsets, numel))
            for i in members:
                self._bucket_of[i] = b
        # per-round state: which parameters' gradients are final, the next bucket to start, whether begun
        self._ready = [0] * len(self.buckets)
        self._fired: list[bool] = [False] * len(self.params)
        self._next = 0
        self._begun = False
        self._sync = True
        self._hooks = []
        if overlap_backward:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
            ]

    @property
    def pending(self) -> bool:
        """True from the first started bucket (or :meth:`begin`) until the reduction is completed."""
        return self._begun or self._next > 0

    # ------------------------------------------------------------------ gradient hooks (overlap with backward)
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not start any reduction (gradient-accumulation micro-batches, as
        ``DistributedDataParallel.no_sync``); the next backward outside it, then :meth:`begin`, reduce the
        accumulated gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._grad_ready(i)

        return hook

    def _grad_ready(self, i: int) -> None:
        if not self._sync or self._begun:
            return  # accumulation micro-batch, or a backward pass while an update is pending (begin() refuses)
        b = self._bucket_of[i]
        if b < self._next:
            raise RuntimeError(
                f"layered SGD: the gradient of parameter #{i} (shape {tuple(self.params[i].shape)}) was accumulated "
                "again after its bucket had been "
                "sent for reduction. For gradient accumulation run the backward passes of all micro-batches but "
                "the last under `PostponedUpdate.no_sync()` (Lightning's accumulate_grad_batches does this)."
            )
        if not self._fired[i]:
            self._fired[i] = True
            self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._start_bucket(self._next)

    def _start_bucket(self, b: int) -> None:
        bucket = self.buckets[b]
        buf, n = bucket.buffer, bucket.numel
        for k, (p, off) in enumerate(zip(bucket.params, bucket.offsets)):
            g = p.grad
            if g is not None:
                buf[off : off + p.numel()].copy_(g.reshape(-1))
                buf[n + k] = 1.0  # presence count, reduced with the gradients
            else:
                buf[off : off + p.numel()].zero_()
                buf[n + k] = 0.0
        self._next = b + 1
        self.allreduce.start(buf)

    # ------------------------------------------------------------------ lines 6 and 8
    def begin(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Start the reduction of every bucket the backward pass has not started yet (in bucket order) and
        record the optimizers' settings."""
        if self._begun:
            raise RuntimeError("PostponedUpdate.begin called while an update is still pending; call apply() first")
        self._optimizers = list(optimizers)
        self._hyper = [
            [{k: copy.copy(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]
            for opt in self._optimizers
        ]
        while self._next < len(self.buckets):
            self._start_bucket(self._next)
        self._begun = True

    # ------------------------------------------------------------------ lines 9 and 10
    def finish_gradients(self) -> bool:
        """Complete the reduction and write the global mean into ``.grad``; False if nothing was pending."""
        if not self._begun:
            return False
        buffers = self.allreduce.finish()
        assert len(buffers) == len(self.buckets)
        for bucket, buffer in zip(self.buckets, buffers):
            self._unpack(bucket, buffer)
        self._reset_round()
        return True

    def _reset_round(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._fired = [False] * len(self.params)
        self._next = 0
        self._begun = False

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

    def abandon(self) -> None:
        """Forget a pending round (after a failure); the buffers' contents are undefined."""
        self._reset_round()
        self._hyper, self._optimizers = None, []

    def close(self) -> None:
        """Remove the gradient hooks (the parameters can then be used without this object)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ unpacking
    @staticmethod
    def _unpack(bucket: _Bucket, buffer: torch.Tensor) -> None:
        n = bucket.numel
        present = (buffer[n:] > 0).tolist()  # one host transfer for the bucket's flags
        for k, (p, off) in enumerate(zip(bucket.params, bucket.offsets)):
            if present[k]:
                mean = buffer[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
            else:
                p.grad = None

"""The sharded layers' weight and bias gradients rounded where one process's autocast rounds them.

Under autocast (``16-mixed``, ``bf16-mixed``) one process multiplies a linear layer in reduced precision: its
weight gradient ``dW = g^T x`` (and its bias gradient, the sum of ``g``) is the output of one reduced-precision
product over the whole batch, accumulated in float32 and rounded once, then cast to the float32 parameter's
gradient.  In float16 that rounding overflows to ``inf`` beyond 65504, which is how a ``GradScaler`` learns that
its scale is too large and skips the step.  The sharded head emulates autocast by computing in float32 on rounded
operands (``HybridHead._autocast_dtype``); its weight and bias gradients are float32 sums over the sub-batches of
every rank, never rounded, so a scale that overflowed one process's product did not overflow the head's: the
scaler skipped steps on one process and not under ``hybrid_fc``, and the runs went apart (final weights 1.9 off on
a two-layer head, where DDP skipped exactly one process's steps).

:class:`AutocastGradients` rounds what each backward pass added to those gradients, once, to the dtype autocast
multiplied the layer in (so an overflow is ``inf`` exactly where one process's product overflows, and the values
are rounded where one process rounds them): the gradient before the pass is kept, and after it the pass's
contribution (the difference) is rounded and added back.  A pass whose gradients were ``None`` before (the
common case, one backward per step) rounds the whole gradient, bit for bit one rounding of the float32 sum.
Gradients of ``weight_norm``'ed shards are those of the parametrization's originals, not of the layer's product:
they are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_hpc.distributed.partitioned import local_block
from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear

__all__ = ["AutocastGradients"]


class AutocastGradients:
    """Call :meth:`before_backward` before a backward pass and :meth:`after_backward` after it, with the shards
    of the heads that ran in the forward; shards whose last training forward ran under autocast
    (:attr:`ShardedLinear.autocast_dtype`) get their pass's gradient contribution rounded to that dtype."""

    def __init__(self) -> None:
        self._before: list[tuple[torch.nn.Parameter, torch.dtype, torch.Tensor | None]] = []

    def before_backward(self, shards: Iterable[ShardedLinear]) -> None:
        self._before = []
        for shard in shards:
            dtype = shard.autocast_dtype
            if dtype is None or shard.weight_norm_dim is not None:
                continue
            for p in (shard.weight, shard.bias):
                if p is not None and p.requires_grad:
                    self._before.append((p, dtype, None if p.grad is None else local_block(p.grad).detach().clone()))

    def after_backward(self) -> None:
        for p, dtype, before in self._before:
            if p.grad is None:
                continue
            g = local_block(p.grad)  # this rank's block, in place
            with torch.no_grad():
                if before is None:
                    g.copy_(g.to(dtype))  # one rounding of this pass's float32 sum
                else:
                    g.copy_(before + (g - before).to(dtype))
        self._before = []

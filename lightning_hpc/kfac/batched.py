"""Batched preconditioning: the every-step products of Eq 13-15 (eigen) or Eq 12 (inverse) for all layers of one
*bucket* in one batched product chain, instead of one chain per layer.

A bucket holds the layers whose preconditioning is the plain Kronecker form (the handler does not override
:meth:`~lightning_hpc.kfac.layers.base.LayerHandler.precondition`) and whose gradient matrices have the same shape,
dtype and device: their gradients are stacked into one ``(B, g_dim, a_dim)`` batch (``(B, groups, g_dim, a_dim)``
for grouped layers) and their decompositions into ``(B, n, n)`` / ``(B, n)`` stacks, and the compute method's
product chain runs once for the batch (the linear algebra of :mod:`lightning_hpc.kfac.linalg` broadcasts over
leading dimensions).  Each layer's block is computed with its own decompositions, so the result is the
per-layer one (the batched and the per-layer products agree to rounding: in float64 within 1e-11 of the
largest entry).

On an accelerator (:func:`~lightning_hpc.kfac.linalg.cache_blocked` False), where a small layer's products cost
their kernel launches rather than their arithmetic, layers of different shapes share a bucket too: a layer whose
gradient is at most :data:`PAD_MAX_DIM` on each side goes to the bucket of the next powers of two of its sides,
its gradient padded with zeros and its factors with an identity block
(:meth:`~lightning_hpc.kfac.methods.ComputeMethod.padded`): the padded layer's preconditioned gradient is its own
beside zeros, for a few times the arithmetic of the small layers (a MobileNetV3's 40-odd distinct small shapes in
a handful of chains). On a CPU, where arithmetic is the cost, buckets hold equal shapes only.

Layers whose gradient matrix is rows of independent blocks (:attr:`~lightning_hpc.kfac.layers.base.LayerHandler.
row_blocks`: a normalisation layer's per-channel (scale, shift) blocks) are grouped by handler type and row width
instead, whatever their number of rows: their gradients and decompositions are concatenated along the rows and the
handler's own preconditioning runs once for all of them (a ResNet-50's 53 BatchNorm layers in one chain). Grouped
layers (``(groups, g_dim, a_dim)`` gradients: a depthwise convolution's channels) whose groups have one shape are
concatenated along their groups the same way, and the compute method's chain runs once for all their groups.

The stacked decompositions are kept between steps and rebuilt only when a member's decompositions are replaced
(every ``inv_update_freq`` steps, or on loading a checkpoint): they cost one more copy of the bucketed
decompositions in memory, in the decomposition dtype.  Layers with their own preconditioning (the per-channel
blocks of normalisation layers are grouped as above; embeddings' diagonal A) and buckets of one layer are
preconditioned one by one.

Also here: the exactly-zero rows and columns of a gradient stay exactly zero (:func:`keep_zeros`), for a bucket
in one masked fill.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hpc._compat import foreach_mul_
from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.linalg import cache_blocked
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["PreconditionBuckets", "keep_zeros", "keep_zeros_by_layer"]


def keep_zeros(precond: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``precond`` with the rows (output units) and columns (inputs) whose gradient is exactly zero set to zero:
    the eigenbasis products would turn them into rounding noise, which adaptive optimizers (Adam) scale up to steps
    of about +-lr, and which differs with the number of processes.  A mask, not a test (no host sync).  The last
    two dimensions are a block's rows and columns; leading ones (groups, a bucket's layers) are blocks of their
    own."""
    zero = grad == 0
    return precond.masked_fill(zero.all(dim=-1, keepdim=True) | zero.all(dim=-2, keepdim=True), 0.0)


#: largest side of a gradient matrix that is padded into a shared bucket on an accelerator (see the module
#: docstring): the eigen route's products of a 256 x 256 layer are about 0.1 GFLOP, microseconds on a GPU
PAD_MAX_DIM = 256


def _padded_side(n: int) -> int:
    return 1 << max(3, (n - 1).bit_length())


def keep_zeros_by_layer(precond: torch.Tensor, grad: torch.Tensor, layer_of_row: torch.Tensor,
                        layers: int) -> torch.Tensor:
    """:func:`keep_zeros` of a row concatenation of ``layers`` layers' ``(rows_i, k)`` gradient matrices
    (``layer_of_row``: the layer of each row): a row is zero on its own, a column is zero when it is zero in all
    rows of its layer. Masks and one segment count, no host sync."""
    zero = grad == 0
    nonzero = torch.zeros(layers, grad.shape[-1], dtype=grad.dtype, device=grad.device)
    nonzero.index_add_(0, layer_of_row, (~zero).to(grad.dtype))
    column_zero = (nonzero == 0).index_select(0, layer_of_row)
    return precond.masked_fill(zero.all(dim=-1, keepdim=True) | column_zero, 0.0)


def _generic(h: LayerHandler) -> bool:
    """The handler preconditions with the plain Kronecker form of its compute method."""
    return type(h).precondition is LayerHandler.precondition


class _Stack:
    """The stacked (or row-concatenated) decompositions of one bucket and the tensors they were joined from (kept,
    so a replaced decomposition is seen by identity, never by a reused id); for row concatenations, the layer of
    each row."""

    __slots__ = ("damping", "layer_of_row", "sources", "stacked")

    def __init__(self, sources: list[tuple[torch.Tensor, ...]], stacked: dict[str, torch.Tensor],
                 layer_of_row: torch.Tensor | None = None, damping: float = 0.0) -> None:
        self.sources, self.stacked, self.layer_of_row = sources, stacked, layer_of_row
        self.damping = damping  # the padding blocks' (the inverse route's identity block depends on it)

    def current(self, sources: list[tuple[torch.Tensor, ...]]) -> bool:
        return len(sources) == len(self.sources) and all(
            len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(sources, self.sources))


class PreconditionBuckets:
    """Preconditions layers bucket by bucket (see the module docstring); :attr:`last_buckets` lists the buckets of
    the last call (layer names), for tests and the setup report."""

    def __init__(self) -> None:
        self._stacks: dict[Hashable, _Stack] = {}
        self.last_buckets: list[list[str]] = []
        #: the tensors the last call's results are views of (one per bucket, row concatenation or single layer):
        #: :meth:`scale_` scales them all in one multi-tensor operation
        self.last_outputs: list[torch.Tensor] = []
        #: the last call's per-layer KL-clip products ``P_i . grad_i`` (Eq 18), one vector per bucket, row
        #: concatenation or single layer, with its layers' names (when asked for: ``kl_terms=True``)
        self.last_kl_terms: list[tuple[list[str], torch.Tensor]] = []

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every result of the last call by ``factor`` in place (the KL clip's ``nu``, a scalar tensor on
        their device: no read-back)."""
        if self.last_outputs:
            dtypes = {t.dtype for t in self.last_outputs}
            if isinstance(factor, torch.Tensor) and len(dtypes) == 1:
                # in the results' dtype, as a Python number is cast by the kernel (one multi-tensor kernel on a GPU)
                factor = factor.to(dtypes.pop())
            foreach_mul_(self.last_outputs, factor)

    def clear(self) -> None:
        """Forget the stacked decompositions (they are rebuilt on the next call)."""
        self._stacks.clear()

    def precondition(self, handlers: Sequence[LayerHandler], grads: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float, dtype: torch.dtype, kl_terms: bool = False) -> dict[str, torch.Tensor]:
        """The preconditioned gradient matrix of each handler (all have decompositions and a gradient in
        ``grads``), in ``dtype``, its exactly-zero rows and columns kept zero; with ``kl_terms``, also each layer's
        ``P_i . grad_i`` (:attr:`last_kl_terms`), a reduction per bucket."""
        buckets: dict[Hashable, list[LayerHandler]] = {}
        rows: dict[Hashable, list[LayerHandler]] = {}
        singles: list[LayerHandler] = []
        for h in handlers:
            g = grads[h.name]
            decomps = tuple(sorted(h.decompositions))
            if _generic(h) and g.dim() == 2 and max(g.shape) <= PAD_MAX_DIM and not cache_blocked(g):
                sides = (_padded_side(g.shape[0]), _padded_side(g.shape[1]))
                buckets.setdefault(("padded", sides, g.dtype, g.device, decomps), []).append(h)
            elif _generic(h) and g.dim() == 3:  # grouped: its groups are blocks of their own, concatenated
                rows.setdefault(("groups", tuple(g.shape[1:]), g.dtype, g.device, decomps), []).append(h)
            elif _generic(h):
                buckets.setdefault((tuple(g.shape), g.dtype, g.device, decomps), []).append(h)
            elif h.row_blocks and g.dim() == 2:
                rows.setdefault(("rows", type(h), g.shape[1], g.dtype, g.device, decomps), []).append(h)
            else:
                singles.append(h)
        out: dict[str, torch.Tensor] = {}
        self.last_buckets, self.last_outputs, self.last_kl_terms = [], [], []
        for key, members in buckets.items():
            if len(members) == 1:
                singles.append(members[0])
                continue
            self.last_buckets.append([h.name for h in members])
            padded: tuple[int, int] | None = key[1] if isinstance(key, tuple) and key[0] == "padded" else None
            if padded is None:
                g = torch.stack([grads[h.name] for h in members])
            else:  # zeros below and right of each layer's gradient
                g = torch.stack([F.pad(grads[h.name], (0, padded[1] - grads[h.name].shape[1],
                                                       0, padded[0] - grads[h.name].shape[0])) for h in members])
            stacked = self._stacked(key, members, dtype, padded=padded, method=method, damping=damping).stacked
            p = keep_zeros(method.precondition(g, stacked, damping), g)
            self._keep(members, p, (p * g.to(p.dtype)).flatten(1).sum(1) if kl_terms else None)
            for h, block in zip(members, p.unbind(0)):
                out[h.name] = block if padded is None else block[: grads[h.name].shape[0], : grads[h.name].shape[1]]
        for key, members in rows.items():
            if len(members) == 1:
                singles.append(members[0])
                continue
            self.last_buckets.append([h.name for h in members])
            g = torch.cat([grads[h.name] for h in members])
            stack = self._stacked(key, members, dtype, rows=True)
            assert stack.layer_of_row is not None
            if isinstance(key, tuple) and key[0] == "groups":
                # grouped layers of equal group shape: the compute method's chain over all their groups, each
                # group's zero rows and columns its own (keep_zeros works per leading index)
                p = keep_zeros(method.precondition(g, stack.stacked, damping), g)
            else:
                # the handler type's own row-by-row preconditioning (row_blocks: it reads only its arguments)
                p = members[0].precondition(g, stack.stacked, method, damping)
                p = keep_zeros_by_layer(p, g, stack.layer_of_row, len(members))
            terms = None
            if kl_terms:
                terms = p.new_zeros(len(members)).index_add_(0, stack.layer_of_row,
                                                            (p * g.to(p.dtype)).flatten(1).sum(-1))
            self._keep(members, p, terms)
            for h, block in zip(members, p.split([grads[h.name].shape[0] for h in members])):
                out[h.name] = block
        buckets.update(rows)
        for h in singles:
            g = grads[h.name]
            p = out[h.name] = keep_zeros(h.preconditioned(g, method, damping, dtype), g)
            self._keep([h], p, (p * g.to(p.dtype)).sum().reshape(1) if kl_terms else None)
        # stacks of buckets that no longer exist (layers skipped this step) are dropped with their memory
        for key in [k for k in self._stacks if k not in buckets]:
            del self._stacks[key]
        return out

    def _keep(self, members: list[LayerHandler], p: torch.Tensor, terms: torch.Tensor | None) -> None:
        self.last_outputs.append(p)
        if terms is not None:
            self.last_kl_terms.append(([h.name for h in members], terms))

    def _stacked(self, key: Hashable, members: list[LayerHandler], dtype: torch.dtype, rows: bool = False,
                 padded: tuple[int, int] | None = None, method: ComputeMethod | None = None,
                 damping: float = 0.0) -> _Stack:
        """The members' decompositions stacked (``rows``: concatenated along their rows; ``padded``: each padded to
        the ``(G, A)`` sides by ``method``'s identity blocks), kept until one of them is replaced."""
        names = sorted(members[0].decompositions)
        sources = [tuple(h.decompositions[k] for k in names) for h in members]
        stack = self._stacks.get(key)
        if stack is None or not stack.current(sources) or (padded is not None and stack.damping != damping):
            join = torch.cat if rows else torch.stack
            parts = [{k: src[j].to(dtype) for j, k in enumerate(names)} for src in sources]
            if padded is not None:
                assert method is not None
                parts = [method.padded(d, {"G": padded[0], "A": padded[1]}, damping) for d in parts]
            stacked: dict[str, Any] = {k: join([d[k] for d in parts]) for k in names}
            layer_of_row = None
            if rows:
                sizes = torch.tensor([src[0].shape[0] for src in sources])
                layer_of_row = torch.arange(len(members)).repeat_interleave(sizes).to(sources[0][0].device)
            stack = self._stacks[key] = _Stack(sources, stacked, layer_of_row, damping)
        return stack

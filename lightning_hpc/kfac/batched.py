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

Host work is per step, not per layer (on a GPU the host's Python is what a small layer costs, beside its kernel
launches): how the layers fall into buckets, each bucket's input and output buffers and every layer's views of
them are a *plan*, kept between steps and rebuilt only when a layer's factors or decompositions are replaced
(:func:`~lightning_hpc.kfac.layers.state.generation`), a layer gains or loses its gradient, or the dtype or the
routes change. A step then fills all buffers from the layers' ``.grad`` with one multi-tensor copy (through each
handler's :meth:`~lightning_hpc.kfac.layers.base.LayerHandler.grad_views`: the weight and bias gradients' places in
the gradient matrix), runs one chain per bucket, and writes all results back with one more; the buffers cost one
copy of the preconditioned gradients in their dtype and one in the decomposition dtype, kept between steps.

Also here: the exactly-zero rows and columns of a gradient stay exactly zero (:func:`keep_zeros`), for a bucket
in one masked fill.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from lightning_hpc._compat import foreach_copy_, foreach_mul_
from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.layers.state import generation
from lightning_hpc.kfac.linalg import cache_blocked
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["PreconditionBuckets", "keep_zeros", "keep_zeros_by_layer"]


def keep_zeros(precond: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``precond`` with the rows (output units) and columns (inputs) whose gradient is exactly zero set to zero:
    the eigenbasis products would turn them into rounding noise, which adaptive optimizers (Adam) scale up to steps
    of about +-lr, and which differs with the number of processes.  On an accelerator a mask, not a test (no host
    sync); on a CPU, where a host read costs nothing, nothing is masked when no row or column is zero.  The last
    two dimensions are a block's rows and columns; leading ones (groups, a bucket's layers) are blocks of their
    own."""
    zero = _zero_mask(grad)
    return precond if zero is None else precond.masked_fill(zero, 0.0)


def _zero_mask(grad: torch.Tensor) -> torch.Tensor | None:
    """:func:`keep_zeros`' mask: the exactly-zero rows and columns of ``grad`` (broadcast over its blocks); None on
    a CPU when ``grad`` has no zero entry at all, the usual case (one count and one host read, a ninth of the mask's
    time on a 2 x 1280 x 321 bucket: the every-step preconditioning of a ConvNeXt-style net spent 8 % of its time
    in the mask)."""
    if cache_blocked(grad) and int(torch.count_nonzero(grad)) == grad.numel():
        return None
    zero = grad == 0
    return zero.all(dim=-1, keepdim=True) | zero.all(dim=-2, keepdim=True)


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
    return precond.masked_fill(_zero_mask_by_layer(grad, layer_of_row, layers), 0.0)


def _zero_mask_by_layer(grad: torch.Tensor, layer_of_row: torch.Tensor, layers: int) -> torch.Tensor:
    """:func:`keep_zeros_by_layer`'s mask."""
    zero = grad == 0
    nonzero = torch.zeros(layers, grad.shape[-1], dtype=grad.dtype, device=grad.device)
    nonzero.index_add_(0, layer_of_row, (~zero).to(grad.dtype))
    return zero.all(dim=-1, keepdim=True) | (nonzero == 0).index_select(0, layer_of_row)


def _generic(h: LayerHandler) -> bool:
    """The handler preconditions with the plain Kronecker form of its compute method."""
    return type(h).precondition is LayerHandler.precondition


class _Stack:
    """The stacked (or row-concatenated) decompositions of one bucket and the tensors they were joined from (kept,
    so a replaced decomposition is seen by identity, never by a reused id); for row concatenations, the layer of
    each row."""

    __slots__ = ("damped", "damped_at", "damping", "layer_of_row", "sources", "stacked")

    def __init__(self, sources: list[tuple[torch.Tensor, ...]], stacked: dict[str, torch.Tensor],
                 layer_of_row: torch.Tensor | None = None, damping: float = 0.0) -> None:
        self.sources, self.stacked, self.layer_of_row = sources, stacked, layer_of_row
        self.damping = damping  # the padding blocks' (the inverse route's identity block depends on it)
        self.damped: dict[str, torch.Tensor] | None = None  # stacked + the method's damped operands
        self.damped_at: float | None = None  # ... at this damping

    def operands(self, method: ComputeMethod, damping: float) -> dict[str, torch.Tensor]:
        """:attr:`stacked` with ``method``'s :meth:`~lightning_hpc.kfac.methods.ComputeMethod.damped_operands` at
        ``damping``, derived once per damping (a damping schedule changes it every step at most)."""
        if self.damped is None or self.damped_at != damping:
            self.damped, self.damped_at = method.damped_operands(self.stacked, damping), damping
        return self.damped

    def current(self, sources: list[tuple[torch.Tensor, ...]]) -> bool:
        return len(sources) == len(self.sources) and all(
            len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(sources, self.sources))


class _Group:
    """One bucket (``kind`` "stack" or "padded"), row concatenation ("groups", "rows") or single layer ("single")
    of a plan: its members, its input buffer ``inp`` (zeros where a padded bucket pads) with each member's gradient
    matrix as a view ``mats[i]``, and its output buffer ``out`` (made at the first step, in the result's dtype)."""

    __slots__ = ("inp", "key", "kind", "mats", "members", "names", "out", "outs", "stack", "zero")

    def __init__(self, kind: str, key: Hashable, members: list[LayerHandler], shapes: list[tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kind, self.key, self.members = kind, key, members
        self.names = [h.name for h in members]
        self.stack: _Stack | None = None  # the stacked decompositions (rows: concatenated), made at the first step
        self.out: torch.Tensor | None = None
        self.outs: list[torch.Tensor] = []
        self.zero: torch.Tensor | None = None  # a scalar zero in the output's dtype
        if kind in ("stack", "padded"):
            side = key[1] if kind == "padded" else shapes[0]  # type: ignore[index]
            self.inp = torch.zeros(len(members), *side, dtype=dtype, device=device)
            self.mats = self._views(self.inp, shapes)
        else:  # rows of all members (a single layer: its own)
            self.inp = torch.zeros(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype, device=device)
            self.mats = list(self.inp.split([s[0] for s in shapes]))

    def _views(self, buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Each member's matrix in ``buf``: a stack's blocks, or the rows and columns of a padded one's."""
        if self.kind == "padded":
            return [block[: s[0], : s[1]] for block, s in zip(buf.unbind(0), shapes)]
        return list(buf.unbind(0)) if self.kind == "stack" else list(buf.split([s[0] for s in shapes]))

    def target(self, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The output buffer, for the chain's last product to write into, when no entry is masked (``zero`` None)
        and the buffer holds results in ``dtype`` (from the first step on); else None."""
        out = self.out
        return out if zero is None and out is not None and out.dtype == dtype and out.shape == self.inp.shape else None

    def output(self, p: torch.Tensor, zero: torch.Tensor | None) -> bool:
        """``p`` with the entries of the mask ``zero`` (None: no entry) set to zero (:func:`keep_zeros`), written
        into the output buffer by one kernel; True when the buffer was made (with its members' views) for it."""
        made = self.out is None or self.out.dtype != p.dtype or self.out.shape != p.shape
        if made:
            self.out, self.zero = torch.empty_like(p), p.new_zeros(())
            self.outs = self._views(self.out, [tuple(m.shape) for m in self.mats])
        if zero is None:
            if p is not self.out:  # not already written there (:meth:`target`)
                self.out.copy_(p)  # type: ignore[union-attr]
        else:
            torch.where(zero, self.zero, p, out=self.out)  # type: ignore[arg-type]
        return made


class _Plan:
    """The groups of one call's layers and what a step needs of them, kept while ``signature`` holds: the
    parameters whose ``.grad`` fill the buffers and their views (:meth:`LayerHandler.grad_views`), the layers
    without such views (``custom``: their :meth:`grad_matrix` / :meth:`set_grad_matrix`), and the layers in the
    order of the KL products."""

    __slots__ = ("custom", "groups", "in_views", "kl_layers", "out_views", "param_views", "params", "signature")

    def __init__(self, signature: Hashable, groups: list[_Group]) -> None:
        self.signature, self.groups = signature, groups
        self.kl_layers = [h for grp in groups for h in grp.members]
        self.params: list[torch.Tensor] = []
        self.param_views: list[tuple[_Group, int, int]] = []  # (group, member, part of grad_views)
        self.custom: list[tuple[LayerHandler, _Group, int]] = []
        for grp in groups:
            for i, (h, mat) in enumerate(zip(grp.members, grp.mats)):
                try:
                    views = h.grad_views(mat)
                except RuntimeError:  # a layout .view cannot express
                    views = None
                if views is None:
                    self.custom.append((h, grp, i))
                    continue
                self.params += h.grad_params()
                self.param_views += [(grp, i, j) for j in range(len(views))]
        #: the input buffers' views the parameters' gradients are copied into, and the custom layers' matrices
        self.in_views = self._views(lambda grp: grp.mats) + [grp.mats[i] for _, grp, i in self.custom]
        #: the output buffers' views the results are written back from (known after the first step)
        self.out_views: list[torch.Tensor] | None = None

    def outputs(self) -> list[torch.Tensor]:
        """The output buffers' views the results are written back from: the parameters', the custom layers'."""
        if self.out_views is None:
            self.out_views = self._views(lambda grp: grp.outs) + [grp.outs[i] for _, grp, i in self.custom]
        return self.out_views

    def _views(self, mats: Any) -> list[torch.Tensor]:
        seen: dict[tuple[int, int], list[torch.Tensor]] = {}
        out = []
        for grp, i, j in self.param_views:
            views = seen.get((id(grp), i))
            if views is None:
                views = seen[(id(grp), i)] = grp.members[i].grad_views(mats(grp)[i]) or []
            out.append(views[j])
        return out


class PreconditionBuckets:
    """Preconditions layers bucket by bucket (see the module docstring): :meth:`precondition` for given gradient
    matrices, :meth:`precondition_grads` and :meth:`write_back` in place on the layers' ``.grad``.
    :attr:`last_buckets` lists the buckets of the last call (layer names), for tests and the setup report."""

    def __init__(self) -> None:
        self._stacks: dict[Hashable, _Stack] = {}
        self._plans: dict[str, _Plan] = {}
        self.last_buckets: list[list[str]] = []
        #: the tensors the last call's results are views of (one per bucket, row concatenation or single layer):
        #: :meth:`scale_` scales them all in one multi-tensor operation
        self.last_outputs: list[torch.Tensor] = []
        #: the last call's per-layer KL-clip products ``P_i . grad_i`` (Eq 18), one vector per bucket, row
        #: concatenation or single layer, with its layers' names (when asked for: ``kl_terms=True``)
        self.last_kl_terms: list[tuple[list[str], torch.Tensor]] = []
        #: the layers of :attr:`last_kl_terms`' products, in their order
        self.last_kl_layers: list[LayerHandler] = []

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
        """Forget the stacked decompositions and the plans (they are rebuilt on the next call)."""
        self._stacks.clear()
        self._plans.clear()

    def precondition(self, handlers: Sequence[LayerHandler], grads: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float, dtype: torch.dtype, kl_terms: bool = False) -> dict[str, torch.Tensor]:
        """The preconditioned gradient matrix of each handler (all have decompositions and a gradient in
        ``grads``), in ``dtype``, its exactly-zero rows and columns kept zero; with ``kl_terms``, also each layer's
        ``P_i . grad_i`` (:attr:`last_kl_terms`), a reduction per bucket. The results are views of buffers the
        next call reuses."""
        if not handlers:
            self.last_buckets, self.last_outputs, self.last_kl_terms, self.last_kl_layers = [], [], [], []
            return {}
        blocked = cache_blocked(grads[handlers[0].name])
        specs = [(h, tuple(grads[h.name].shape), grads[h.name].dtype, grads[h.name].device) for h in handlers]
        signature = (generation(), blocked, dtype, id(method), tuple((id(h), *spec[1:]) for h, *spec in specs))
        plan = self._plan("matrices", signature, specs, blocked)
        foreach_copy_([m for grp in plan.groups for m in grp.mats],
                      [grads[h.name] for grp in plan.groups for h in grp.members])
        self._run(plan, method, damping, dtype, kl_terms)
        return {h.name: o for grp in plan.groups for h, o in zip(grp.members, grp.outs)}

    def precondition_grads(self, handlers: Sequence[LayerHandler], weights: Sequence[torch.Tensor],
                           method: ComputeMethod, damping: float, dtype: torch.dtype, kl_terms: bool = False) -> bool:
        """Precondition, from their ``.grad``, the ``handlers`` (``weights``: their weights) that have factors,
        decompositions and a weight gradient, into the output buffers (:attr:`last_outputs`, :attr:`last_kl_terms`
        as :meth:`precondition`'s); :meth:`write_back` then writes them into ``.grad``. False: no such layer."""
        present = [w.grad is not None for w in weights]
        # the weights list is kept by the caller: a new one (parameters re-read) is a new plan
        signature = (generation(), dtype, bool(weights) and cache_blocked(weights[0]), id(method), id(weights),
                     tuple(present))
        plan = self._plans.get("grads")
        if plan is None or plan.signature != signature:
            chosen = [h for h, has in zip(handlers, present) if has and h.factors and h.decompositions]
            specs = [(h, h.grad_shape, w.dtype, w.device) for h, w in zip(chosen, [h.weight for h in chosen])]
            plan = self._plan("grads", signature, specs, signature[2])  # type: ignore[arg-type]
        if not plan.groups:
            self.last_buckets, self.last_outputs, self.last_kl_terms, self.last_kl_layers = [], [], [], []
            return False
        grads = [p.grad for p in plan.params]
        for i in [i for i, g in enumerate(grads) if g is None]:  # a bias without a gradient: zero, as grad_matrix
            grads[i] = plan.params[i].grad = torch.zeros_like(plan.params[i])
        foreach_copy_(plan.in_views, grads + [h.grad_matrix() for h, _, _ in plan.custom])  # type: ignore[arg-type]
        self._run(plan, method, damping, dtype, kl_terms)
        return True

    def write_back(self) -> None:
        """Copy :meth:`precondition_grads`' results (scaled by :meth:`scale_` if it was called) into ``.grad``:
        one multi-tensor copy, and the layers without gradient views one by one."""
        plan = self._plans["grads"]
        out = plan.outputs()
        n = len(plan.params)
        foreach_copy_([p.grad for p in plan.params], out[:n])  # type: ignore[misc]
        for (h, _, _), mat in zip(plan.custom, out[n:]):
            h.set_grad_matrix(mat)

    def _plan(self, which: str, signature: Hashable, specs: list[tuple[LayerHandler, tuple[int, ...], torch.dtype,
              torch.device]], blocked: bool) -> _Plan:
        """The kept plan ``which`` if its signature holds, else a new one from ``specs``: (handler, gradient
        matrix shape, dtype, device) of each layer."""
        plan = self._plans.get(which)
        if plan is not None and plan.signature == signature:
            return plan
        Spec = tuple[LayerHandler, tuple[int, ...], torch.dtype, torch.device]
        buckets: dict[Hashable, list[Spec]] = {}
        rows: dict[Hashable, list[Spec]] = {}
        singles: list[Spec] = []
        for spec in specs:
            h, shape, dt, dev = spec
            decomps = tuple(sorted(h.decompositions))
            if _generic(h) and len(shape) == 2 and max(shape) <= PAD_MAX_DIM and not blocked:
                sides = (_padded_side(shape[0]), _padded_side(shape[1]))
                buckets.setdefault(("padded", sides, dt, dev, decomps), []).append(spec)
            elif _generic(h) and len(shape) == 3:  # grouped: its groups are blocks of their own, concatenated
                rows.setdefault(("groups", shape[1:], dt, dev, decomps), []).append(spec)
            elif _generic(h):
                buckets.setdefault((shape, dt, dev, decomps), []).append(spec)
            elif h.row_blocks and len(shape) == 2:
                rows.setdefault(("rows", type(h), shape[1], dt, dev, decomps), []).append(spec)
            else:
                singles.append(spec)
        groups: list[_Group] = []
        for bucket, parts in ((True, buckets), (False, rows)):
            for key, members in parts.items():
                if len(members) == 1:
                    singles.append(members[0])
                    continue
                first = key[0]  # type: ignore[index]
                kind = ("padded" if first == "padded" else "stack") if bucket else first
                groups.append(_Group(kind, key, [m[0] for m in members], [m[1] for m in members], *members[0][2:]))
        groups += [_Group("single", h.name, [h], [shape], dt, dev) for h, shape, dt, dev in singles]
        # stacks of buckets that no longer exist (layers skipped this step) are dropped with their memory
        keys = {grp.key for grp in groups}
        for key in [k for k in self._stacks if k not in keys]:
            del self._stacks[key]
        plan = self._plans[which] = _Plan(signature, groups)
        return plan

    def _run(self, plan: _Plan, method: ComputeMethod, damping: float, dtype: torch.dtype, kl_terms: bool) -> None:
        """Every group's chain on its filled input buffer, into its output buffer."""
        self.last_buckets = [grp.names for grp in plan.groups if grp.kind != "single"]
        self.last_outputs, self.last_kl_terms, self.last_kl_layers = [], [], plan.kl_layers
        for grp in plan.groups:
            g, kind, members = grp.inp, grp.kind, grp.members
            stack = grp.stack
            if kind == "single":
                h = members[0]  # its decompositions in dtype (LayerHandler.preconditioned's), kept with the plan
                stack = grp.stack = stack or _Stack([], method.product_operands(h.state.decompositions_in(dtype)))
                operands = stack.operands(method, damping) if _generic(h) else stack.stacked
                p, zero = h.precondition(g, operands, method, damping), _zero_mask(g)
            elif kind in ("stack", "padded"):
                padded = grp.key[1] if kind == "padded" else None  # type: ignore[index]
                if stack is None or (padded is not None and stack.damping != damping):
                    stack = grp.stack = self._stacked(grp.key, members, dtype, padded=padded, method=method,
                                                      damping=damping)
                zero = _zero_mask(g)
                p = method.precondition(g, stack.operands(method, damping), damping, grp.target(zero, dtype))
            else:
                stack = grp.stack = stack or self._stacked(grp.key, members, dtype, rows=True)
                assert stack.layer_of_row is not None
                if kind == "groups":
                    # grouped layers of equal group shape: the compute method's chain over all their groups, each
                    # group's zero rows and columns its own (the mask works per leading index)
                    zero = _zero_mask(g)
                    p = method.precondition(g, stack.operands(method, damping), damping, grp.target(zero, dtype))
                else:
                    # the handler type's own row-by-row preconditioning (row_blocks: it reads only its arguments)
                    p = members[0].precondition(g, stack.stacked, method, damping)
                    zero = _zero_mask_by_layer(g, stack.layer_of_row, len(members))
            if grp.output(p, zero):
                plan.out_views = None
            out = grp.out
            assert out is not None
            self.last_outputs.append(out)
            if kl_terms:  # P_i . grad_i of Eq 18: one reduction per group
                product = out * g.to(out.dtype)
                if kind == "single":
                    terms = product.sum().reshape(1)
                elif kind in ("stack", "padded"):
                    terms = product.flatten(1).sum(1)
                else:
                    assert stack is not None and stack.layer_of_row is not None
                    terms = out.new_zeros(len(members)).index_add_(0, stack.layer_of_row, product.flatten(1).sum(-1))
                self.last_kl_terms.append((grp.names, terms))

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
            if method is not None:
                stacked = method.product_operands(stacked)
            layer_of_row = None
            if rows:
                sizes = torch.tensor([src[0].shape[0] for src in sources])
                layer_of_row = torch.arange(len(members)).repeat_interleave(sizes).to(sources[0][0].device)
            stack = self._stacks[key] = _Stack(sources, stacked, layer_of_row, damping)
        return stack


"""The model-parallel fully-connected head (Krizhevsky, "One weird trick", section 4).

:class:`HybridHead` replaces the head module of a model.  Its forward receives this rank's trunk activations
(b x d), runs the scheme's exchange (``schemes.py``), the sharded layers (``sharded_linear.py``, layouts from
``layout.py``) on each sub-batch, hands every example's logits back to its owner and returns this rank's
``b x C`` logits, so the model's own ``forward`` and any loss work unchanged.

Two update modes (section 4.2):

``fc_update="per_step"``  plain autograd: the returned logits carry the whole graph (exchanges, sharded layers,
    deliveries are autograd functions), the loss's ``backward()`` fills the shards' gradients with the gradient
    of the mean loss over all K x b examples (the 1/K of :func:`scale_grad`), which is exactly synchronous SGD on
    the concatenated batch.
``fc_update="per_subbatch"`` (schemes b, c; a has one sub-batch so it equals per_step): the head is updated after
    every sub-batch with that sub-batch's gradient (effective batch (K x b, b)).  The loss has to be known inside
    the forward, so the caller opens :meth:`HybridHead.subbatch_update` with the targets, the loss function and
    the head optimizer; the forward then runs forward+backward+step per sub-batch and returns logits whose
    backward injects the accumulated activation gradients into the trunk.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd import Function
from torch.nn import functional as F

from lightning_hpc.hybrid_fc.collectives import ByteCounter, HeadComm
from lightning_hpc.hybrid_fc.functions import gather_neurons, reduce_scatter_neurons, round_to
from lightning_hpc.hybrid_fc.layout import plan_layout
from lightning_hpc.hybrid_fc.parametrized import col_only
from lightning_hpc.hybrid_fc.schemes import (
    SCHEMES,
    exchange_in,
    exchange_start,
    make_exchange,
)
from lightning_hpc.hybrid_fc.sequential_view import IndexedLikeSequential
from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear, gather_shard_tensors

__all__ = ["HybridHead", "FC_UPDATES", "SubbatchContext"]

FC_UPDATES = ("per_step", "per_subbatch")


@dataclass
class SubbatchContext:
    """What the per-sub-batch update needs inside the forward."""

    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step: Callable[[], None]


class _InjectGrad(Function):
    """Returns precomputed logits; backward hands the trunk the activation gradient accumulated over the
    sub-batches, scaled by how the caller's loss relates to the loss used inside (``c`` in ``c * loss``: gradient
    accumulation and loss scaling divide or multiply the loss)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, logits: torch.Tensor, grad_x: torch.Tensor, grad_logits: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(grad_x, grad_logits)
        return logits.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        grad_x, grad_logits = ctx.saved_tensors
        denom = float((grad_logits * grad_logits).sum())
        scale = float((g * grad_logits).sum()) / denom if denom > 0 else 1.0
        if denom > 0:
            residual = float(((g - scale * grad_logits) ** 2).sum()) / max(float((g * g).sum()), 1e-30)
            if residual > 1e-6:
                warnings.warn(
                    "fc_update='per_subbatch': the training loss differs from the loss the head was updated with "
                    "(its gradient is not a multiple of the head's); the trunk gets the head's loss gradient",
                    stacklevel=2,
                )
        return grad_x * scale, None, None, None


class HybridHead(IndexedLikeSequential, nn.Module):
    """Sharded replacement of a fully-connected head.

    ``linears`` are the head's ``nn.Linear`` layers in order; ``between[i]`` the element-wise modules after
    linear i (``between[-1]`` after the last one, applied to the owner's logits); ``before`` the element-wise
    modules before the first linear (applied by the owner before the exchange).  ``names`` gives the name each
    module had in the original head so ``state_dict`` keys are unchanged.  The full head weights must be equal on
    all ranks when this is built (:func:`parallelize_head` broadcasts them from rank 0 first), unless they are on
    the meta device: then each rank allocates only its shards on ``device``, initialised by ``head_init(shard)``
    or :meth:`ShardedLinear.reset_parameters`.  ``exchange_group`` (same ranks as ``group``) carries the
    activation exchange so it overlaps the head's own collectives (see ``schemes.py``); ``overlap=False`` turns
    the overlap off (to measure it).
    """

    def __init__(
        self,
        linears: Sequence[nn.Linear],
        between: Sequence[Sequence[nn.Module]],
        before: Sequence[nn.Module],
        names: dict[int, str],
        scheme: str = "c",
        fc_update: str = "per_step",
        group: Any = None,
        counter: ByteCounter | None = None,
        layouts: Sequence[str] | None = None,
        exchange_group: Any = None,
        device: torch.device | str | None = None,
        head_init: Callable[[ShardedLinear], None] | None = None,
        overlap: bool = True,
        shard_class: type[ShardedLinear] = ShardedLinear,
    ) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES} (section 4 of the paper), got {scheme!r}")
        if fc_update not in FC_UPDATES:
            raise ValueError(f"fc_update must be one of {FC_UPDATES} (section 4.2), got {fc_update!r}")
        self.comm = HeadComm(group, counter)
        # Activations travel on their own group so the head's collectives never queue behind them (schemes.py).
        self.xcomm = HeadComm(exchange_group, self.comm.counter) if exchange_group is not None else self.comm
        self.k, self.rank = self.comm.k, self.comm.rank
        if fc_update == "per_subbatch" and scheme == "a":
            raise ValueError(
                "fc_update='per_subbatch' updates the head after each of the K sub-batches of schemes 'b' and 'c' "
                "(section 4.2); scheme 'a' has a single sub-batch of K x b examples. Use scheme='b' or 'c', or "
                "fc_update='per_step'"
            )
        self.scheme, self.fc_update = scheme, fc_update
        widths = [linears[0].in_features] + [lin.out_features for lin in linears]
        for i in range(1, len(linears)):
            if linears[i].in_features != linears[i - 1].out_features:
                raise ValueError(
                    f"head linear {i} expects {linears[i].in_features} inputs but linear {i - 1} gives "
                    f"{linears[i - 1].out_features}"
                )
        pinned = col_only(linears)  # weight-normalised layers: whole rows per rank (parametrized.py)
        self.layouts = list(layouts) if layouts is not None else plan_layout(widths, self.k, pinned)
        if len(self.layouts) != len(linears):
            raise ValueError(f"layouts has {len(self.layouts)} entries for {len(linears)} linear layers")
        for i in pinned:
            if self.layouts[i] != "col":
                raise ValueError(
                    f"layouts={self.layouts}: head linear {i} is weight-normalised (weight_norm), which the head "
                    "splits exactly with the 'col' layout only (each rank holds whole rows, so every row norm is "
                    "its own); give it 'col' or leave layouts unset"
                )
        self.widths = widths
        self._order: list[tuple[str, nn.Module]] = []
        self.shards: list[ShardedLinear] = []
        self.before = list(before)
        self.between: list[list[nn.Module]] = [list(ops) for ops in between]
        # Register every module under its original name (state_dict keys match the unsharded model).
        idx = 0
        for op in before:
            self.add_module(names[idx], op)
            idx += 1
        for i, lin in enumerate(linears):
            shard = shard_class(lin, self.layouts[i], self.rank, self.k, device=device, init=head_init)
            shard.partition_parameters(self.comm.group)
            self.add_module(names[idx], shard)
            self.shards.append(shard)
            idx += 1
            for op in self.between[i]:
                self.add_module(names[idx], op)
                idx += 1
        self.exchange = make_exchange(scheme, self.comm, self.xcomm, overlap)
        #: scheme 'a' for a per-step batch of fewer rows per rank than scheme 'c' has slices (an epoch's short last
        #: batch): the per-step update is the same synchronous SGD step whatever the sub-batches (section 4.2)
        self._one_subbatch = make_exchange("a", self.comm, self.xcomm, overlap) if scheme == "c" else self.exchange
        self._subbatch: SubbatchContext | None = None
        #: the head as the user built it (``parallel.UserHead``, set by ``parallelize_head``; not a child module)
        self.user_head: Any = None
        #: full (weight, bias) of every linear while :meth:`whole_head_inference` is open (else None)
        self._whole: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    # -- the sharded layers on one replicated sub-batch --------------------------------------------------
    def _layers(self, x: torch.Tensor, grad_scale: float, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The sharded layers on one sub-batch.  With ``compute_dtype`` (autocast's, see :meth:`_autocast_dtype`)
        ``x`` is float32 holding values of that precision, every product runs in float32 on operands rounded to
        it, and each layer's output (forward) and input gradient (backward) is rounded once its cross-rank sum
        is complete: where one process's autocast rounds the whole layer's matrix product."""
        h = x
        last = len(self.shards) - 1
        for i, shard in enumerate(self.shards):
            if i == 0 and shard.layout == "row":
                a, b = shard.in_bounds[self.rank]
                h = h[:, a:b]
            out = shard(h, grad_scale, compute_dtype)
            if i == last:
                return out
            if shard.layout == "row":
                out = reduce_scatter_neurons(out, self.comm, shard.out_sizes)
            out = round_to(out, compute_dtype)  # the layer's output, complete: one process's rounded product
            for op in self.between[i]:
                out = op(out)
            # the next layer's input (autocast's cast) and, backward, its gradient once the reduce-scatter
            # behind the all-gather below has summed every rank's partial product
            out = round_to(out, compute_dtype, grad=True)
            if self.shards[i + 1].layout == "col":
                out = gather_neurons(out, self.comm, shard.out_sizes)
            h = out
        raise AssertionError("unreachable")

    def _post(self, logits: torch.Tensor) -> torch.Tensor:
        for op in self.between[-1]:
            logits = op(logits)
        return logits

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(
                "the hybrid head expects flattened trunk activations of shape (batch, features), got "
                f"{tuple(x.shape)}; "
                "the head must start after the model's flatten"
            )
        if x.shape[1] != self.widths[0]:
            raise ValueError(f"the head's first linear layer expects {self.widths[0]} features, got {x.shape[1]}")
        for op in self.before:
            x = op(x)
        return x

    @property
    def class_sizes(self) -> list[int]:
        return self.shards[-1].out_sizes

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2 and not (self.training and torch.is_grad_enabled() and self.fc_update == "per_subbatch"):
            # (batch, ..., features), e.g. a transformer's tokens: every row is one input of the linear layers
            positions = x[0].numel() // x.shape[-1] if x.shape[0] else 1
            for shard in self.shards:  # K-FAC's sharded handler counts rows as samples: it must know (and refuses)
                shard.kfac_positions = positions
            try:
                return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
            finally:
                for shard in self.shards:
                    shard.kfac_positions = 1
        x = self._pre(x)
        if self._whole is not None:
            return self._forward_whole(x)
        if self.training and torch.is_grad_enabled() and self.fc_update == "per_subbatch":
            if self._subbatch is None:
                raise RuntimeError(
                    "fc_update='per_subbatch' updates the head inside the training forward and needs the targets, loss "
                    "and head optimizer: wrap the forward in `with head.subbatch_update(targets, loss_fn, "
                    "head_optimizer.step):` "
                    "(HybridParallelStrategy does this), or call it under torch.no_grad()/eval() for inference"
                )
            return self._forward_per_subbatch(x, self._subbatch)
        dt = self._autocast_dtype(x)
        with self._autocast_off(x, dt):
            # the activations enter (and their gradients leave, after the exchange's reverse sum) rounded
            x = round_to(x.float(), dt, grad=True) if dt is not None else x
            ex = self._one_subbatch if x.shape[0] < self.k else self.exchange
            ex.start(x.detach())
            xs = exchange_start(x, ex)
            outs = []
            for j in range(ex.num_subbatches()):
                xj = exchange_in(xs, ex, j)
                out = self._layers(xj, 1.0 / self.k, dt)
                outs.append(self._logits_out(ex.deliver(j, out, self.layouts[-1], self.class_sizes), dt))
        return self._post(torch.cat(outs, 0))

    @staticmethod
    def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
        """Autocast's dtype where autocast would run the head's layers in it (a float32 or already reduced ``x``),
        else ``None``.  One process's autocast multiplies the whole layer in one product (accumulated in float32)
        and rounds its result once; a shard's product, or its partial sum, rounded before the ranks' sum would
        round twice (the 2-process weights drifted from one bf16 process by 5x what DDP's do, on a 3-layer head
        of width 64).  So the head computes in float32 on rounded operands, its collectives carry float32 (twice
        the bytes), and it rounds where one process rounds (:meth:`_layers`)."""
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return None
        dtype = torch.get_autocast_dtype(device)
        return dtype if x.dtype in (torch.float32, dtype) else None

    @staticmethod
    def _autocast_off(x: torch.Tensor, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(x.device.type, enabled=False) if dtype is not None else contextlib.nullcontext()

    @staticmethod
    def _logits_out(rows: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The delivered logits as one process's autocast returns them: rounded, in ``dtype`` (the loss's
        gradient comes back rounded to it, as on one process)."""
        return rows if dtype is None else round_to(rows, dtype).to(dtype)

    def _forward_per_subbatch(self, x: torch.Tensor, ctx: SubbatchContext) -> torch.Tensor:
        """Section 4.2: forward, backward and head update for each sub-batch in turn; the activation gradients'
        return trip of sub-batch j overlaps the computation of sub-batch j+1."""
        ex = self.exchange
        b = x.shape[0]
        dt = self._autocast_dtype(x)
        ex.start(x.detach().float().to(dt).float() if dt is not None else x.detach())
        logits_parts, reverse = [], []
        for j in range(ex.num_subbatches()):
            xj = ex.wait(j).detach().requires_grad_(True)
            # Each example weighs 1/b in this rank's loss; b / n_j turns the head's gradient into the mean over
            # the n_j examples of the sub-batch (its own SGD step with batch n_j, section 4.2).
            with self._autocast_off(x, dt):
                out = self._layers(xj, b / ex.subbatch_size(j), dt)
                rows = self._logits_out(ex.deliver(j, out, self.layouts[-1], self.class_sizes), dt)
            r0, r1 = ex.owned_rows(j)
            if r1 > r0:
                rows_leaf = rows.detach().requires_grad_(True)
                with torch.enable_grad():
                    logits_j = self._post(rows_leaf)
                    # A mean loss over this rank's b examples, restricted to the rows in this sub-batch: each
                    # example keeps weight 1/b, so the head sees the mean gradient of the sub-batch's b examples.
                    loss_j = ctx.loss_fn(logits_j, ctx.targets[r0:r1]) * ((r1 - r0) / b)
                    (g_rows,) = torch.autograd.grad(loss_j, rows_leaf)
                logits_parts.append(logits_j.detach())
            else:
                g_rows = torch.zeros_like(rows)
            torch.autograd.backward(rows, g_rows)
            assert xj.grad is not None  # rows depend on xj, so the backward above filled its gradient
            reverse.append((j, ex.reverse(j, xj.grad, async_op=True)))
            if not ex.overlap:
                reverse[-1][1].wait()
            ctx.step()
        grad_x = torch.zeros_like(x)
        for j, pending in reverse:
            part = pending.wait()
            r0, r1 = ex.owned_rows(j)
            if r1 > r0:
                grad_x[r0:r1] += part if dt is None else part.to(dt)  # rounded once the ranks' sum is complete
        logits = torch.cat(logits_parts, 0)
        # Reference gradient of the caller's loss w.r.t. the logits, to recover the caller's scaling in backward.
        logits_ref = logits.detach().requires_grad_(True)
        with torch.enable_grad():
            (g_ref,) = torch.autograd.grad(ctx.loss_fn(logits_ref, ctx.targets), logits_ref)
        return _InjectGrad.apply(x, logits, grad_x, g_ref)

    def _forward_whole(self, x: torch.Tensor) -> torch.Tensor:
        """The unsharded head on this rank's rows alone: no collective, so ranks may run different batch sizes and
        different numbers of batches (Lightning's predict sampler)."""
        h = x
        assert self._whole is not None
        for i, (weight, bias) in enumerate(self._whole):
            h = F.linear(h, weight, bias)
            if i < len(self._whole) - 1:
                for op in self.between[i]:
                    h = op(h)
        return self._post(h)

    @contextlib.contextmanager
    def whole_head_inference(self) -> Iterator[int]:
        """Within this block every rank holds the full head (all-gathered once on entry: collective, call on every
        rank of the head's group) and the forward computes it locally, with no exchange: inference on unequal
        per-rank batches, e.g. ``trainer.predict`` with Lightning's unpadded predict sampler, where the sharded
        forward would need every rank in each batch.  The result equals the sharded head's (the same products on
        whole rows instead of blocks of them).  Costs the full head's memory on each rank while open; yields its
        size in bytes."""
        self._whole = [(shard.whole_weight(full), full.get("bias"))
                       for shard, full in zip(self.shards, self.gather_layers())]
        try:
            yield sum(t.numel() * t.element_size() for w, b in self._whole for t in (w, b) if t is not None)
        finally:
            self._whole = None

    def gather_layers(self, cpu: bool = False, device: torch.device | None = None) -> list[dict[str, torch.Tensor]]:
        """The full parameters of every linear layer of the head by their names in the layer (``weight``, ``bias``;
        a weight_norm'ed layer's ``g`` and ``v`` in place of ``weight``), on every rank (collective over the head's
        group; ``cpu``: each gathered tensor lands in host memory as it arrives; ``device``: where the collectives
        run, for a head kept elsewhere, :func:`gather_shard_tensors`)."""
        shards: dict[str, tuple[ShardedLinear, str, torch.Tensor]] = {
            f"{i}/{pname}": (shard, pname, shard.get_parameter(pname))
            for i, shard in enumerate(self.shards)
            for pname in shard.param_names
        }
        full = gather_shard_tensors(shards, self.comm.group, rank0_only=False, cpu=cpu, device=device)
        return [{pname: full[f"{i}/{pname}"] for pname in shard.param_names} for i, shard in enumerate(self.shards)]

    @contextlib.contextmanager
    def subbatch_update(
        self,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        step: Callable[[], None],
    ) -> Iterator[None]:
        """Within this block a training forward updates the head after every sub-batch (fc_update="per_subbatch").

        ``loss_fn(logits, targets)`` must be a mean over the examples (as ``ImageClassifier.loss``); ``step()``
        applies the head optimizer and clears the shards' gradients (see :class:`HeadOptimizer`)."""
        if self.fc_update != "per_subbatch":
            raise RuntimeError("subbatch_update is only meaningful with fc_update='per_subbatch'")
        self._subbatch = SubbatchContext(targets, loss_fn, step)
        try:
            yield
        finally:
            self._subbatch = None

    def extra_repr(self) -> str:
        return f"scheme={self.scheme}, fc_update={self.fc_update}, K={self.k}, layouts={self.layouts}"


"""The whole model's flat vectors on every rank, for an optimizer that views every parameter as one vector
(``torch.optim.LBFGS``), under a strategy that splits some parameters over the ranks.

LBFGS (Nocedal, "Updating quasi-Newton matrices with limited storage", 1980; torch's port of minFunc) builds one
flat gradient of all its parameters, and everything it decides comes from that vector: the curvature pairs
``(s, y)`` and their dot products, the two-loop recursion, the first step's length ``1 / |g|_1``, the
directional derivative, the strong-Wolfe line search's tests, and the stopping rules (``max |g|``,
``max |d t|``, the change of the loss).  Under a model-parallel strategy a rank holds only blocks of some
parameters (:class:`~lightning_hpc.distributed.partitioned.BlockTensor`: hybrid_fc's sharded head, multigrid's
residual steps), so a flat vector of its own parameters would give each rank its own step, and the replicated
layers' copies would drift apart (or the ranks would take different numbers of closure evaluations and their
collectives would no longer pair).

:class:`WholeFlatView` makes every flat vector the *whole* model's, in the order one process's LBFGS lays it
out (its parameters in the param group's order, each flattened whole):

* the flat gradient: the replicated parameters' gradients as they are (the strategy averaged them already) and
  every block's gradient gathered whole over the blocks' group, in one ``all_gather`` per evaluation (each
  rank's blocks flattened into one buffer, padded to the longest rank's);
* the update ``x += t d``: each rank adds to a block only the slice of the whole ``d`` that is its block;
* the loss each closure returns: averaged over the data-parallel group (one scalar ``all_reduce``), so the line
  search and the stopping rule on the loss test the loss of the global batch, as one process does.

So every dot product, maximum, step length and stopping decision is computed from the same vectors, in the same
order, on every rank: the ranks take the same step as one process on the global batch (up to the rounding of
the gradients themselves), and the same number of closure evaluations.  The line search's saved parameters
(``_clone_param`` / ``_set_param``) stay per block.  The cost: LBFGS's own memory (``history_size`` pairs of
flat vectors, plus a few) is the whole model's on every rank, and one gather of the split parameters'
gradients per closure evaluation.

Where a block lies in the whole flat vector follows from its partition: a block split along a dimension
(``Partition.dim`` an integer; uneven blocks allowed, see
:func:`lightning_hpc.distributed.partition.block_bounds`) is the whole tensor's slice along it, the ranks'
blocks concatenated in group-rank order; blocks stacked along a new dimension (``STACKED``: multigrid's
residual steps, each a whole tensor on one rank) stand, between two replicated parameters, rank after rank (the
serial model's order, :func:`lightning_hpc.multigrid.checkpoint.serial_layout`).

Its state (``d``, the curvature pairs, ``prev_flat_grad``, ...) is then the whole model's flat vectors, equal on
every rank, kept under the first parameter as torch keeps it: checkpoints hold it as one process writes it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc._compat import all_gather_single, replace_lbfgs_flat_views
from lightning_hpc.distributed.partitioned import STACKED, is_block, local_block

__all__ = ["WholeFlatView", "keeps_global_state", "whole_flat_views"]


def keeps_global_state(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps one state for all its parameters under its first one (``torch.optim.LBFGS``:
    its flat vectors), rather than one state per parameter."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.LBFGS)


@dataclass(frozen=True)
class _Segment:
    """One whole tensor, or one run of stacked blocks, in the whole flat vector.

    ``local``: this rank's parameter index (``None``: it holds none of it); ``pieces``: (rank, offset in that
    rank's gathered buffer, shape) of each rank's part (empty for a replicated tensor); ``dim``: the dimension
    the pieces are concatenated along (``None``: a stacked run, each piece one after the other); ``whole``: the
    whole tensor's shape (a split one) and ``start``: where this rank's block begins along ``dim``."""

    local: tuple[int, ...]
    numel: int
    pieces: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    dim: int | None = None
    whole: tuple[int, ...] = ()
    start: int = 0


def _kind(p: torch.Tensor) -> str | int:
    if not is_block(p):
        return "replicated"
    dim = p._partition.dim  # type: ignore[attr-defined]
    if dim is None:
        raise ValueError(
            "torch.optim.LBFGS over a model-parallel parameter whose blocks' layout is not known (its Partition has "
            "no dim): the whole flat vector LBFGS computes with cannot be assembled from the blocks. Give the "
            "partition its dim, or use a first-order optimizer (SGD, Adam)"
        )
    return STACKED if dim == STACKED else int(dim)


class WholeFlatView:
    """The flat gradient, update and loss of LBFGS over ``params`` (this rank's: replicated parameters and
    blocks) as one process's over the whole model (see the module's docstring).  Collective at construction
    (the ranks' block shapes are exchanged once over the blocks' group); ``data_group``: the group whose ranks
    hold different samples (the loss is averaged over it; ``None``: the world)."""

    def __init__(self, params: Sequence[torch.Tensor], data_group: dist.ProcessGroup | None) -> None:
        self.params = list(params)
        self.data_group = data_group
        blocks = [p for p in self.params if is_block(p)]
        groups = {id(p._partition.group): p._partition.group for p in blocks}  # type: ignore[attr-defined]
        if len(groups) > 1:
            raise ValueError(
                "torch.optim.LBFGS over parameters split over different process groups: its whole flat vector is "
                "gathered over one group. Give LBFGS the parameters of one split (or use a first-order optimizer)"
            )
        self.group = next(iter(groups.values()), None)
        self.split = bool(blocks) and dist.is_initialized() and dist.get_world_size(self.group) > 1
        self.dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params), self.params[0].dtype)
        self.device = self.params[0].device
        if any(p.is_complex() for p in blocks):
            raise ValueError("torch.optim.LBFGS over a complex model-parallel parameter is not supported: use a "
                             "real parametrization of it, or a first-order optimizer")
        if self.split:
            self._plan()

    # -- layout --------------------------------------------------------------------------------------------
    def _plan(self) -> None:
        """The segments of the whole flat vector and each rank's gathered buffer, from every rank's kinds and
        shapes of its parameters (exchanged once)."""
        mine = [(_kind(p), tuple(p.shape)) for p in self.params]
        ranks: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(ranks, mine, group=self.group)
        me = self.me = dist.get_rank(self.group)
        offsets = [0] * len(ranks)  # next free place in each rank's buffer
        positions = [0] * len(ranks)  # next parameter of each rank
        segments: list[_Segment] = []

        def stacked_run() -> None:
            pieces: list[tuple[int, int, tuple[int, ...]]] = []
            local: list[int] = []
            numel = 0
            for r, share in enumerate(ranks):
                while positions[r] < len(share) and share[positions[r]][0] == STACKED:
                    shape = share[positions[r]][1]
                    pieces.append((r, offsets[r], shape))
                    if r == me:
                        local.append(positions[r])
                    n = _numel(shape)
                    offsets[r] += n
                    numel += n
                    positions[r] += 1
            if pieces:
                segments.append(_Segment(tuple(local), numel, tuple(pieces)))

        while True:
            stacked_run()
            if all(positions[r] == len(share) for r, share in enumerate(ranks)):
                break
            if any(positions[r] == len(share) for r, share in enumerate(ranks)):
                raise _misaligned()
            aligned: list[tuple[str | int, tuple[int, ...]]] = [share[positions[r]] for r, share in enumerate(ranks)]
            kind = aligned[me][0]
            if any(a[0] != kind for a in aligned):
                raise _misaligned()
            index = positions[me]
            if kind == "replicated":
                p = self.params[index]
                segments.append(_Segment((index,), p.numel() * (2 if p.is_complex() else 1)))
            else:
                dim = int(kind)
                pieces = []
                for r, (_, shape) in enumerate(aligned):
                    pieces.append((r, offsets[r], shape))
                    offsets[r] += _numel(shape)
                start = sum(shape[dim] for _, shape in aligned[:me])
                whole = list(aligned[me][1])
                whole[dim] = sum(shape[dim] for _, shape in aligned)
                segments.append(_Segment((index,), _numel(tuple(whole)), tuple(pieces), dim, tuple(whole), start))
            for r in range(len(ranks)):
                positions[r] += 1
        self.segments = segments
        self.buffer = max(offsets)
        self.numel = sum(s.numel for s in segments)

    # -- the flat vectors ------------------------------------------------------------------------------------
    def _flat(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient as LBFGS flattens it (zeros where it has none)."""
        param = self.params[index]
        g = param.grad  # the parameter's own (a plain alias of a block has no gradient)
        if g is None:
            p = local_block(param)
            return p.new_zeros(p.numel() * (2 if p.is_complex() else 1), dtype=p.real.dtype)
        g = local_block(g)
        view = g.to_dense().view(-1) if g.is_sparse else g.view(-1)
        return torch.view_as_real(view).view(-1) if view.is_complex() else view

    def flat_grad(self) -> torch.Tensor:
        """The whole model's flat gradient (the same on every rank)."""
        if not self.split:
            return torch.cat([self._flat(i) for i in range(len(self.params))])
        held = [self._flat(i) for s in self.segments if s.pieces for i in s.local]
        local = torch.zeros(self.buffer, dtype=self.dtype, device=self.device)
        if held:
            mine = torch.cat(held)
            local[: mine.numel()] = mine
        gathered = torch.empty(self.buffer * dist.get_world_size(self.group), dtype=self.dtype, device=self.device)
        all_gather_single(gathered, local, group=self.group)
        rows = gathered.view(-1, self.buffer)
        out = []
        for s in self.segments:
            if not s.pieces:
                out.append(self._flat(s.local[0]))
                continue
            parts = [rows[r, o : o + _numel(shape)] for r, o, shape in s.pieces]
            if s.dim is None:
                out.extend(parts)
            else:
                blocks = [part.view(shape) for part, (_, _, shape) in zip(parts, s.pieces)]
                out.append(torch.cat(blocks, s.dim).reshape(-1))
        return torch.cat(out)

    @torch.no_grad()
    def add(self, step_size: float, update: torch.Tensor) -> None:
        """``x += step_size * update`` for the whole flat ``update``: each parameter (block) gets its slice."""
        if not self.split:
            offset = 0
            for p in self.params:
                p = local_block(p)
                view = torch.view_as_real(p) if p.is_complex() else p
                view.add_(update[offset : offset + view.numel()].view_as(view), alpha=step_size)
                offset += view.numel()
            return
        offset = 0
        for s in self.segments:
            whole = update[offset : offset + s.numel]
            offset += s.numel
            if not s.local:
                continue
            if not s.pieces:  # replicated
                p = local_block(self.params[s.local[0]])
                view = torch.view_as_real(p) if p.is_complex() else p
                view.add_(whole.view_as(view), alpha=step_size)
            elif s.dim is None:  # this rank's stacked blocks, after the lower ranks' ones
                at = sum(_numel(shape) for r, _, shape in s.pieces if r < self.me)
                for i in s.local:
                    p = local_block(self.params[i])
                    p.add_(whole[at : at + p.numel()].view_as(p), alpha=step_size)
                    at += p.numel()
            else:
                assert s.dim is not None
                p = local_block(self.params[s.local[0]])
                p.add_(whole.view(s.whole).narrow(s.dim, s.start, p.shape[s.dim]), alpha=step_size)

    def average_loss(self, loss: Any) -> Any:
        """The loss of the global batch: ``loss`` (this rank's batch's mean) averaged over the data group."""
        if loss is None or not dist.is_initialized() or dist.get_world_size(self.data_group) == 1:
            return loss
        value = torch.as_tensor(loss, device=self.device).detach().clone()
        dist.all_reduce(value, group=self.data_group)
        return value / dist.get_world_size(self.data_group)


def _misaligned() -> ValueError:
    return ValueError(
        "torch.optim.LBFGS: the ranks' param groups do not hold the same replicated and split parameters in the "
        "same order, so their whole flat vector cannot be laid out as one process's; build the optimizer from the "
        "model's parameters (or a filter of them) in the model's order"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Installed:
    """A view installed on one LBFGS instance; :meth:`remove` gives it torch's own flat vectors back."""

    def __init__(self, optimizer: torch.optim.LBFGS, view: WholeFlatView) -> None:
        self.optimizer, self.view = optimizer, view
        self._step = optimizer.__dict__.get("step")  # an LR scheduler's wrapper, where one was made
        inner_step = optimizer.step

        def step(opt: torch.optim.LBFGS, closure: Callable[[], Any]) -> Any:
            return inner_step(lambda: view.average_loss(closure()))

        # a bound method, as torch's LR schedulers expect of ``optimizer.step`` (they wrap its ``__func__``)
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        replace_lbfgs_flat_views(optimizer, view.flat_grad, view.add)

    def remove(self) -> None:
        """torch's flat vectors again, over the optimizer's current param group (a rebind replaced it)."""
        replace_lbfgs_flat_views(self.optimizer, None, None)
        if self._step is not None:
            self.optimizer.step = self._step  # type: ignore[method-assign]
        else:
            del self.optimizer.step


def whole_flat_views(optimizers: Sequence[Any], data_group: dist.ProcessGroup | None) -> list[_Installed]:
    """Install a :class:`WholeFlatView` on every ``torch.optim.LBFGS`` among ``optimizers`` (Lightning's wrappers
    included); collective over the split parameters' group.  Returns them, for ``remove()`` when the model is
    whole again."""
    out = []
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.LBFGS):
            out.append(_Installed(inner, WholeFlatView(inner.param_groups[0]["params"], data_group)))
    return out

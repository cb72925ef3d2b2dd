"""The factor all-reduce overlapped with the backward pass (KAISA, Pauloski et al., SC21, arXiv:2107.01739:
a layer's factor communication starts as soon as its factors are computed, while the backward pass continues on
earlier layers, as bucketed gradient all-reduce does).

A layer's statistics for an optimizer step are final when the backward pass of the step's last micro-batch has
delivered the output gradient of every call of the layer in that forward pass (A is known from the forward
pass). :class:`OverlappedFactorAllreduce` groups the layers into fixed buckets and launches a bucket's
asynchronous all-reduce (``async_op=True``, upper triangles as :func:`~.collectives.allreduce_mean_symmetric`)
as soon as all of its layers are final; :meth:`~OverlappedFactorAllreduce.finish`, at the optimizer step,
launches the buckets that are still waiting, waits for all of them and returns the averaged batch factors.

Rules that keep every rank's collectives matched, whatever the order the hooks fire in:

* the buckets are fixed: layers in reverse registration order (the order the backward pass reaches them),
  consecutive layers of one statistics dtype up to the size cap, computed from the layer shapes alone, so they
  are the same on every rank;
* buckets launch strictly in that order: a bucket that is ready behind one that is not waits for it, and
  :meth:`~OverlappedFactorAllreduce.flush` launches the rest, in order, at the step. A layer whose hooks do not
  fire in the last micro-batch (unused in this step, used on some ranks only, or a call whose output does not
  reach the loss) therefore delays its bucket and the later ones to the step, but never leaves a rank waiting
  for a collective the others do not start;
* a bucket launches once per step: a layer counts once however often its hooks fire;
* the collectives run on a group of their own (every rank, the world's timeout), so where they fall between
  the strategy's gradient all-reduce buckets, which differs between ranks when the hooks fire differently,
  does not matter;
* at the step one small all-reduce (on that group, after the buckets) sums, per layer, whether it had
  statistics in its bucket (a layer is only updated when it had on every rank, as in the synchronous path) and
  whether any rank captured statistics after the layer's bucket had left (gradient accumulation without
  :meth:`KFACPreconditioner.no_sync`): then every rank discards the overlapped result and reduces the complete
  statistics synchronously, so the factors never miss a micro-batch.

Everything goes through the :class:`~lightning_hpc.distributed.comm.Communicator` and the buffers live on the
layers' device, so the same code is correct on NCCL: the collective is ordered after the hook's computation on
the current stream, and waiting orders later work after it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_hpc.distributed.comm import Communicator, Handle
from lightning_hpc.kfac.layers import LayerHandler

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["FactorBucket", "OverlappedFactorAllreduce", "make_overlap", "plan_factor_buckets"]


@dataclass
class FactorBucket:
    """Layers (handler indices, in launch order) whose factors are all-reduced in one flat buffer."""

    layers: list[int]
    dtype: torch.dtype
    numel: int = 0


def plan_factor_buckets(handlers: Sequence[LayerHandler], cap_bytes: int, symmetric: bool) -> list[FactorBucket]:
    """The fixed buckets: layers in reverse registration order, consecutive layers of one statistics dtype up to
    ``cap_bytes`` (a single larger layer fills a bucket alone). Only shapes and dtypes decide, so every rank
    plans the same buckets."""
    out: list[FactorBucket] = []
    for i in reversed(range(len(handlers))):
        h = handlers[i]
        dtype = h.dtype_for(h.weight)  # what the hooks compute the statistics in (float32, or float64)
        numel = h.state.packed_numel(symmetric)
        nbytes = numel * dtype.itemsize
        last = out[-1] if out else None
        if last is None or last.dtype != dtype or (last.numel * dtype.itemsize + nbytes > cap_bytes):
            out.append(FactorBucket([i], dtype, numel))
        else:
            last.layers.append(i)
            last.numel += numel
    return out


@dataclass
class _InFlight:
    bucket: FactorBucket
    flat: torch.Tensor
    handle: Handle
    #: per layer of the bucket: it had statistics when the bucket left, and its commit count then
    included: list[bool] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)


class OverlappedFactorAllreduce:
    """Launches the factor all-reduce bucket by bucket from the backward hooks (see the module docstring).

    Args:
        comm: the communicator (its ``allreduce(..., async_op=True)`` must return a pending handle).
        handlers: the preconditioned layers, in registration order.
        cap_bytes: bucket size cap (``bucket_cap_mb``).
        symmetric: all-reduce only the upper triangles (``symmetric_allreduce``).
        batch_averaged: the loss is a mean over the step's samples (scaling of G, :mod:`.layers`).
        group: the communicator group the buckets and the status run on (None: the world).
        device: where the flat buffers live (the layers' device: CUDA tensors for NCCL, CPU for gloo).
    """

    def __init__(
        self,
        comm: Communicator,
        handlers: Sequence[LayerHandler],
        cap_bytes: int,
        symmetric: bool,
        batch_averaged: bool,
        group: Any,
        device: torch.device,
    ) -> None:
        self.comm = comm
        self.handlers = list(handlers)
        self.cap_bytes = cap_bytes
        self.symmetric = symmetric
        self.batch_averaged = batch_averaged
        self.group = group
        self.device = device
        self._plan_key: tuple[Any, ...] | None = None
        self.buckets: list[FactorBucket] = []
        self._bucket_of: dict[int, int] = {}
        #: buckets launched from a backward hook (not by :meth:`flush`) since construction, for tests and logs
        self.launched_in_backward = 0
        self.reset()

    # -- per-step state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget this step's launches (after :meth:`finish` or :meth:`abandon`)."""
        self._done: set[int] = set()
        self._remaining: list[int] | None = None
        self._next = 0
        self._in_flight: list[_InFlight] = []
        #: the step's last backward pass has started delivering statistics on this rank
        self.armed = False

    def _start(self) -> list[int]:
        if self._remaining is None:  # the step's first launch or flush
            # dtypes and devices may change after construction (Lightning moves the model after the callbacks'
            # setup): buffers follow the layers (CUDA for NCCL), and the plan is redone if a dtype changed
            self.device = self.handlers[0].weight.device
            key = tuple((h.dtype_for(h.weight), h.state.packed_numel(self.symmetric)) for h in self.handlers)
            if key != self._plan_key:
                self.buckets = plan_factor_buckets(self.handlers, self.cap_bytes, self.symmetric)
                self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.layers}
                self._plan_key = key
            self._remaining = [len(b.layers) for b in self.buckets]
        return self._remaining

    @property
    def launched(self) -> int:
        """Buckets launched in the current step."""
        return self._next

    # -- launching ---------------------------------------------------------------------------------------
    def layer_done(self, index: int) -> None:
        """Layer ``index``'s statistics for this step are final: launch its bucket when all of its layers are,
        and every ready bucket behind it, in bucket order. Called from the backward hooks; a second call for
        the same layer in a step does nothing."""
        remaining = self._start()
        self.armed = True
        if index in self._done:
            return
        self._done.add(index)
        remaining[self._bucket_of[index]] -= 1
        while self._next < len(self.buckets) and remaining[self._next] == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.launched_in_backward += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order (the step: no more statistics will arrive)."""
        self._start()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _launch(self, bucket: FactorBucket) -> None:
        parts: list[torch.Tensor] = []
        included: list[bool] = []
        commits: list[int] = []
        for i in bucket.layers:
            h = self.handlers[i]
            commits.append(h.stats.commits)
            if h.has_statistics:
                # the loss scale is applied after the average (finish): the hooks do not know it
                factors = h.batch_statistics(1.0, self.batch_averaged)
                parts.append(h.state.pack(factors, self.symmetric).to(self.device, bucket.dtype))
                included.append(True)
            else:  # no statistics on this rank: zeros keep the buffer's layout; the status says so
                parts.append(torch.zeros(h.state.packed_numel(self.symmetric), dtype=bucket.dtype, device=self.device))
                included.append(False)
        flat = torch.cat(parts)
        handle = self.comm.allreduce(flat, op="mean", group=self.group, async_op=True)
        self._in_flight.append(_InFlight(bucket, flat, handle, included, commits))

    # -- the step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, grad_scale: float) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]] | None:
        """Launch what is left, wait, and return ``(fired, factors)``: per layer the fraction of ranks whose
        statistics were in the average (1: every rank), and the averaged factors (by name) of the layers every
        rank contributed to (the output-gradient ones divided by ``grad_scale**2``). None when some rank captured
        statistics after the layer's bucket left: the caller then reduces synchronously. Resets the step."""
        self.flush()
        world = self.comm.group_size(self.group)
        n = len(self.handlers)
        included = [0.0] * n
        late = 0.0
        for f in self._in_flight:
            for i, inc, commits in zip(f.bucket.layers, f.included, f.commits):
                included[i] = 1.0 if inc else 0.0
                if self.handlers[i].stats.commits != commits:
                    late = 1.0
        status = torch.tensor(included + [late], dtype=torch.float32, device=self.device)
        # after the buckets on the same group: the status takes its place in the same order on every rank
        self.comm.allreduce(status, op="sum", group=self.group).wait()
        for f in self._in_flight:
            f.handle.wait()
        counts = status.cpu().tolist()
        in_flight, self._in_flight = self._in_flight, []
        self.reset()
        if counts[-1] > 0:
            return None
        fired = [c / world for c in counts[:n]]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for f in in_flight:
            offset = 0
            for i in f.bucket.layers:
                h = self.handlers[i]
                size = h.state.packed_numel(self.symmetric)
                factors = h.state.unpack(f.flat[offset : offset + size], self.symmetric)
                offset += size
                if fired[i] >= 1.0 - 1e-6:
                    out[i] = h.state.unscale(factors, grad_scale)
        return fired, out

    def abandon(self) -> None:
        """The step's statistics are dropped (AMP overflow, a step skipped by the user): when this rank's last
        backward pass launched anything, launch the rest too (the other ranks do the same, so the group's
        collectives stay matched), wait for all of them and forget them."""
        if self.armed or self._in_flight:
            self.flush()
            for f in self._in_flight:
                f.handle.wait()
        self.reset()


def make_overlap(pre: KFACPreconditioner, stacklevel: int = 2) -> OverlappedFactorAllreduce | None:
    """The overlapped factor all-reduce of ``pre`` when ``overlap_factor_allreduce`` is set and there is someone to
    talk to. Its buckets run on a group of their own (created here, collectively, with the world's timeout), so
    their position among the strategy's gradient all-reduces and K-FAC's other collectives, which depends on
    when each rank's hooks fire, does not matter. A communicator whose ``async_op=True`` collectives complete
    before returning (``async_collectives = False``) gets the synchronous path, with a warning (``stacklevel``
    counted from the caller)."""
    comm = pre.comm
    if not pre.options.overlap_factor_allreduce or comm.world_size == 1:
        return None
    gathered = [h.name for h in pre.handlers if h.gathers_statistics]
    if gathered:
        # their factors need a gather over the layer's ranks at the step, which backward hooks cannot run in
        # the same order on every rank
        raise ValueError(
            f"K-FAC overlap_factor_allreduce=True: layer(s) {gathered[:5]} are sharded over ranks (hybrid_fc's "
            "fully-connected head), whose factors are gathered whole at the optimizer step; use "
            "overlap_factor_allreduce=False (the default), or skip_layers=[...] to leave them to the optimizer"
        )
    if not comm.async_collectives:
        warnings.warn(
            f"K-FAC overlap_factor_allreduce: {type(comm).__name__} has no asynchronous collectives; the "
            "factors are all-reduced synchronously at the optimizer step",
            UserWarning,
            stacklevel=stacklevel,
        )
        return None
    group = comm.new_group(range(comm.world_size))
    return OverlappedFactorAllreduce(
        comm, pre.handlers, pre.bucket_cap_bytes, pre.options.symmetric_allreduce, pre.batch_averaged,
        group, pre.comm_device(),
    )

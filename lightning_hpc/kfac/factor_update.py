"""The factor update of a :class:`~lightning_hpc.kfac.preconditioner.KFACPreconditioner` (step 1 of Algorithm 1,
SC20): this step's batch factors of every layer whose hooks fired on every rank, averaged over the ranks (at the
step, or launched from the backward hooks by :mod:`.overlap`) and folded into the running averages (Eq 16-17),
unless any is non-finite.

Layers tiled by spatial parallelism hold partial factors (:class:`~lightning_hpc.kfac.layers.TiledConvHandler`):
summed over their spatial group and averaged over sample groups in the same all-reduce (their handlers pack them
scaled by the group size). Warnings are said once per preconditioner (:meth:`KFACPreconditioner.warn_once`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lightning_hpc._compat import foreach_add_, foreach_mul_, foreach_norm
from lightning_hpc.kfac.collectives import allreduce_mean
from lightning_hpc.kfac.layers import ConvHandler, LayerHandler, TiledConvHandler

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = [
    "active_layers",
    "check_partitions",
    "enable_subsampling",
    "fold_factors",
    "fold_running_averages",
    "note_shared_layers",
    "reduce_factors",
    "resolve_grad_scale",
    "update_factors",
]

Batch = dict[LayerHandler, dict[str, torch.Tensor]]


def check_partitions(handlers: Sequence[LayerHandler], world: int) -> None:
    """Spatially tiled layers (:class:`~lightning_hpc.kfac.layers.TiledConvHandler`) hold partial factors over
    ``partition_size`` ranks: the world must consist of whole groups of that size, all of one size."""
    sizes = {h.partition_size for h in handlers if h.partition_size > 1}
    if not sizes:
        return
    if len(sizes) > 1 or world % next(iter(sizes)) != 0:
        raise ValueError(
            f"K-FAC: the model's spatially partitioned layers split each sample over {sorted(sizes)} ranks, which "
            f"does not fit the communicator's world of {world} ranks (it must be sample groups x one spatial "
            "group size); declare the model's convolutions with one spatial grid (spatial_parts) whose size "
            "divides the world size, and give K-FAC the world communicator"
        )


def enable_subsampling(handlers: Sequence[LayerHandler], fraction: float, seed: int) -> torch.Generator | None:
    """The generator that draws the convolutions' A-factor sample subsets (``conv_input_sample_fraction`` below
    1, :attr:`ConvHandler.sample_fraction`), given to every convolution's handler; None at a fraction of 1."""
    if fraction >= 1.0:
        return None
    tiled = [h.name for h in handlers if isinstance(h, TiledConvHandler)]
    if tiled:
        raise ValueError(
            f"K-FAC conv_input_sample_fraction < 1 is not supported for spatially tiled layers ({tiled[:3]}): the "
            "ranks of a spatial group would have to draw the same samples; use conv_input_sample_fraction=1.0"
        )
    generator = torch.Generator().manual_seed(seed)
    for h in handlers:
        if isinstance(h, ConvHandler):
            h.sample_fraction = fraction
            h.generator = generator
    return generator


def resolve_grad_scale(pre: KFACPreconditioner, grad_scale: float | None) -> float:
    """The loss scale the captured output gradients carry: ``grad_scale`` if given, else the ``grad_scaler``'s
    current scale, else 1 -- refused when float16 output gradients were captured with neither (AMP's scale
    would enter G squared and make every update near zero)."""
    if grad_scale is not None:
        return float(grad_scale)
    if pre.grad_scaler is not None:
        return float(pre.grad_scaler.get_scale()) if pre.grad_scaler.is_enabled() else 1.0
    if pre.is_factor_update_step and any(h.stats.g_dtype == torch.float16 for h in pre.handlers):
        raise ValueError(
            "K-FAC captured float16 output gradients but was not told the loss scale they carry: pass "
            "KFACPreconditioner(..., grad_scaler=scaler), or call step(grad_scale=scaler.get_scale()) after "
            "scaler.unscale_(optimizer) (grad_scale=1.0 for float16 without a GradScaler)"
        )
    return 1.0


def update_factors(pre: KFACPreconditioner, grad_scale: float) -> None:
    """Reduce this step's factors (the overlapped all-reduce's result when it covered them all) and fold them."""
    batch: Batch | None = None
    if pre.overlap is not None:
        result = pre.overlap.finish(grad_scale)
        if result is None:
            pre.warn_once(
                "late",
                "K-FAC overlap_factor_allreduce: statistics were captured after a layer's factors had been "
                "launched (gradient accumulation without KFACPreconditioner.no_sync() on the earlier "
                "micro-batches); this step's factors are reduced again, synchronously, from all of them",
                stacklevel=4,
            )
        else:
            fired, reduced = result
            active_layers(pre, fired)  # warns about layers that did not fire on every rank
            batch = {pre.handlers[i]: reduced[i] for i in sorted(reduced)}
    if batch is None:
        batch = reduce_factors(pre, grad_scale)
    fold_factors(pre, batch)


def note_shared_layers(pre: KFACPreconditioner) -> None:
    """One note, the first time, for layers called more than once per forward pass."""
    shared = [
        (h.name, h.max_calls_per_forward)
        for h in pre.handlers
        if h.max_calls_per_forward > 1 and f"calls:{h.name}" not in pre.warned
    ]
    if not shared:
        return
    pre.warned.update(f"calls:{name}" for name, _ in shared)
    warnings.warn(
        f"K-FAC: layer(s) called more than once per forward pass {shared[:5]} (name, calls): each is treated as "
        "one layer applied at several positions (KFC's weight sharing): samples are counted once per forward "
        "pass, every call's inputs are rows of A, so G equals a single call on the calls' inputs stacked along "
        "a position dimension",
        UserWarning,
        stacklevel=4,
    )


def active_layers(pre: KFACPreconditioner, fired: list[float]) -> list[LayerHandler]:
    """The layers whose hooks fired on every rank (``fired``: the fraction of ranks, per layer); one warning
    for each other layer, the first time."""
    if pre.handlers and not any(f > 0 for f in fired) and not pre._hooks.forward_hooks_ran:
        # No layer captured anything on any rank and no forward hook ran here since the last step, though the
        # step has gradients: the forward bypassed the hooks (an eval-mode forward runs them and is only
        # warned about below).  Ranks run the same code, so every rank refuses at this factor step, before
        # the optimizer's update.
        raise RuntimeError(
            f"K-FAC: none of the hooks of the {len(pre.handlers)} layers it preconditions fired in a training "
            "step whose gradients reached them: the forward ran code that does not call the modules' hooks. "
            "The usual cause is torch.compile reusing code it compiled for the same module class before K-FAC "
            "registered its hooks (compiled code is not guarded on hooks added to another instance); call "
            "torch._dynamo.reset() before training the compiled model under K-FAC"
        )
    active: list[LayerHandler] = []
    for h, f in zip(pre.handlers, fired):
        if f >= 1.0 - 1e-6:
            active.append(h)
        elif h.left_out is None:  # (a layer left out since setup was said to be when it was)
            pre.warn_once(
                h.name,
                f"K-FAC: the hooks of layer {h.name!r} ({type(h.module).__name__}) did not fire in a training "
                "step on every rank (used functionally, output unused, or shared oddly); its factors are not "
                "updated and its gradient is left to the optimizer until they exist",
                stacklevel=5,
            )
    return active


def reduce_factors(pre: KFACPreconditioner, grad_scale: float) -> Batch:
    """The batch factors of the layers whose hooks fired on every rank, averaged over the ranks at the step
    (the synchronous path: all buckets in flight at once, after the backward pass)."""
    comm = pre.comm
    fired = torch.tensor([1.0 if h.has_statistics else 0.0 for h in pre.handlers])
    if comm.world_size > 1:
        # A layer is updated only if its hooks fired on every rank, so the factor allreduce matches.
        fired = fired.to(pre.comm_device())
        comm.allreduce(fired, op="sum").wait()
        fired = fired.cpu() / comm.world_size
    active = active_layers(pre, fired.tolist())
    batch = {h: h.batch_statistics(grad_scale, pre.batch_averaged) for h in active}
    if comm.world_size > 1:
        # each layer's factors packed by their forms (tiled layers' partial factors scaled to sums over their
        # spatial group); replicated layers (heads after global pooling) hold the same factor on every rank of
        # a spatial group: the plain world mean counts each group once
        symmetric = pre.options.symmetric_allreduce
        packed = {h: h.state.pack(f, symmetric) for h, f in batch.items()}
        allreduce_mean(comm, list(packed.values()), pre.bucket_cap_bytes)
        batch = {h: h.state.unpack(v, symmetric) for h, v in packed.items()}
    return batch


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Every entry of every tensor is finite, with one host synchronisation for all layers in the common case.

    First from the tensors' 2-norms, one multi-tensor reduction (a GPU launches a few kernels for all layers, not
    two per factor): a NaN or an infinity makes its tensor's norm non-finite. A finite tensor whose squares
    overflow (entries beyond about 1e19 in float32) has an infinite norm too, so a non-finite norm is confirmed
    entry by entry from each such tensor's ``aminmax`` (one read; a NaN propagates to both bounds, an infinity is
    the largest or the smallest entry) before a step is dropped."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    finite = torch.isfinite(torch.stack(foreach_norm(tensors, 2.0)))
    if bool(finite.all()):
        return True
    suspects = [t for t, ok in zip(tensors, finite.tolist()) if not ok]
    return bool(torch.isfinite(torch.cat([torch.stack(torch.aminmax(t)) for t in suspects])).all())


def fold_factors(pre: KFACPreconditioner, batch: Batch) -> None:
    """Fold the averaged batch factors into each layer's running averages (Eq 16-17), unless any is
    non-finite."""
    if batch and not _all_finite([t for factors in batch.values() for t in factors.values()]):
        # A NaN / Inf statistic on any rank is non-finite in the averaged factors on every rank, so every rank
        # drops the same step. Folded in, it would stay in the running averages for the rest of the run.
        pre.dropped_statistics_steps += 1
        bad = [h.name for h, factors in batch.items() if not _all_finite(list(factors.values()))]
        pre.warn_once(
            "nonfinite",
            f"K-FAC: non-finite factor statistics in step {pre.steps} (layers {bad[:5]}); this step's "
            "statistics are dropped and the running factors kept (said once; dropped_statistics_steps "
            "counts them)",
            stacklevel=5,
        )
        return
    fold_running_averages(batch, pre.current_factor_decay(), pre.factor_dtype)


def fold_running_averages(batch: Batch, decay: float, dtype: torch.dtype) -> None:
    """Eq 16-17 for every layer of ``batch``: the running factors stored in ``dtype`` of the layers that have them
    and this step's factors in that dtype are folded in two multi-tensor operations for all of them (a GPU launches
    a few kernels, not two per factor); first factors and narrower storage go layer by layer
    (:meth:`~lightning_hpc.kfac.layers.state.FactorState.fold`, the same arithmetic)."""
    running: list[torch.Tensor] = []
    new: list[torch.Tensor] = []
    for h, factors in batch.items():
        current = h.state.factors
        if current and all(k in current and f.dtype == dtype == current[k].dtype for k, f in factors.items()):
            for k, f in factors.items():
                running.append(current[k])
                new.append(f)
        else:
            h.state.fold(factors, decay, dtype)
    if running:
        foreach_mul_(running, decay)
        foreach_add_(running, new, alpha=1.0 - decay)

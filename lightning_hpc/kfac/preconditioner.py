"""``KFACPreconditioner``: the distributed K-FAC gradient preconditioner of Pauloski et al. (SC20), plain torch.

Usage (paper Listing 1)::

    precond = KFACPreconditioner(model, optimizer=optimizer, damping=0.003, inv_update_freq=10)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()      # gradients averaged across ranks (DDP / strategy) by now
        precond.step()                       # rewrites .grad of every Linear / ConvNd in place
        optimizer.step()                     # any torch optimizer

Per optimizer step (Algorithm 1):

1. On factor-update steps (every ``factor_update_freq``), forward/backward hooks capture layer inputs and
   output gradients of every micro-batch; ``step`` forms the batch factors (see :mod:`.layers` for the scaling),
   averages them across ranks (asynchronous, bucketed allreduce; with ``overlap_factor_allreduce`` launched from
   the backward hooks of the step's last micro-batch, overlapping the rest of the backward pass as in KAISA,
   SC21: :mod:`.overlap`) and folds them into the running averages
   (Eq 16-17; ``factor_decay`` is the weight of the old average, as in the SC20 code and its range [0.9, 1)).
   Layers tiled by spatial parallelism (:class:`~lightning_hpc.kfac.layers.TiledConvHandler`) hold partial
   factors: summed over their spatial group, averaged over sample groups, in the same allreduce.
2. On decomposition steps (every ``inv_update_freq``), each factor is decomposed once, on the rank chosen by
   ``placement`` (:mod:`.placement`), in float32 (or float64), and shared with the layer's gradient workers by
   one broadcast per owning rank. ``compute_method="eigen"`` stores eigenpairs (Eq 13-15), ``"inverse"`` damped
   inverses (Eq 11).
3. Every step, each layer's gradient is preconditioned by its gradient workers (KAISA's ``grad_worker_fraction``,
   SC21, arXiv:2107.01739: all ranks at fraction 1, the default except under ``layer_wise``; one owner at ``1 / world``,
   K-FAC-lw), who broadcast the result to the other ranks of their broadcast group; it is then scaled by the
   KL-clip factor of Eq 18 and written back into ``.grad``.

Steps that update neither factors nor decompositions communicate nothing when every rank is a gradient worker
of every layer (``grad_worker_fraction=1``).
All collectives go through a :class:`~lightning_hpc.distributed.comm.Communicator`, so the Horovod backend
can be swapped in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator
from lightning_hpc.kfac.batched import PreconditionBuckets
from lightning_hpc.kfac.collectives import allreduce_mean, broadcast_by_owner
from lightning_hpc.kfac.discovery import find_layers
from lightning_hpc.kfac.layers import ConvHandler, LayerHandler, TiledConvHandler, base_type
from lightning_hpc.kfac.methods import COMPUTE_METHODS, make_method
from lightning_hpc.kfac.options import KFACOptions, compile_skip_patterns
from lightning_hpc.kfac.overlap import OverlappedFactorAllreduce
from lightning_hpc.kfac.placement import GradWorkerGrid, grad_workers_for, make_placement
from lightning_hpc.kfac.schedules import value_at
from lightning_hpc.kfac.subclasses import FUNCTIONAL_OPS, CallTracer, ConvGeometry

__all__ = ["COMPUTE_METHODS", "KFACPreconditioner"]

_log = logging.getLogger("lightning_hpc.kfac")


class KFACPreconditioner:
    """Preconditions the gradients of a model's ``nn.Linear`` and ``nn.Conv1d/2d/3d`` layers with K-FAC (SC20
    Alg. 1).

    The decomposition and preconditioning rules are a :class:`~lightning_hpc.kfac.methods.ComputeMethod`
    (``self.method``: Eq 13-15 or Eq 11-12); which rank decomposes what, and who preconditions, a
    :class:`~lightning_hpc.kfac.placement.Placement` (``self.placement_policy``).

    Args:
        model: the module whose Linear / Conv1d/2d/3d layers are preconditioned (every other parameter is
            untouched).
        lr: learning rate for Eq 18 when no optimizer is given (float or zero-argument callable);
            ``step(lr=...)`` overrides it.
        optimizer: optimizer whose parameter-group lr Eq 18 uses (the group holding each layer's weight).
        communicator: collectives backend; default :class:`TorchDistributedCommunicator`.
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop: ``step()`` then reads the loss scale
            the captured output gradients carry from it. Without it, a step whose captured output gradients are
            float16 must be told the scale (``step(grad_scale=scaler.get_scale())``, or ``grad_scale=1.0`` for
            fp16 without loss scaling): forgetting it would inflate G by the squared scale and shrink every update.
        announce: say once, at construction, which modules are preconditioned and which are left to the
            optimizer, and why (logged at INFO; a ``UserWarning`` when trainable modules are left out). The
            Lightning callback announces on rank 0 instead.
        factor_update_freq ... overlap_factor_allreduce: the hyper-parameters, typed keyword arguments that are the
            fields of :class:`~lightning_hpc.kfac.options.KFACOptions` (documented and validated there; a test keeps
            the two in step). :meth:`from_options` takes a ready ``KFACOptions``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float | Callable[[], float] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        communicator: Communicator | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        announce: bool = True,
        factor_update_freq: int | Callable[[int], int] | None = None,
        inv_update_freq: int | Callable[[int], int] = 100,
        factor_decay: float | Callable[[int], float] = 0.95,
        damping: float | Callable[[int], float] = 0.001,
        damping_decay_epochs: Sequence[int] = (),
        damping_decay_rate: float = 1.0,
        update_freq_decay_epochs: Sequence[int] = (),
        update_freq_decay_rate: float = 1.0,
        kl_clip: float | Callable[[int], float] | None = 0.001,
        compute_method: str = "eigen",
        placement: str = "balanced",
        grad_worker_fraction: float | None = None,
        skip_layers: str | Sequence[str] | None = None,
        layer_types: Sequence[str] | None = None,
        decomposition_dtype: torch.dtype | str = "float32",
        factor_dtype: torch.dtype | str | None = None,
        inverse_dtype: torch.dtype | str | None = None,
        batch_averaged: bool = True,
        bucket_cap_mb: float = 25.0,
        conv_input_sample_fraction: float = 1.0,
        subsample_seed: int = 0,
        symmetric_allreduce: bool = True,
        overlap_factor_allreduce: bool = False,
    ) -> None:
        options = KFACOptions.from_arguments(locals())  # the fields among this call's arguments
        self.options = options
        self.schedule = options.schedule
        #: xi of Eq 16-17 and kappa of Eq 18: constants or callables of the step (see :meth:`current_factor_decay`)
        self.factor_decay = options.factor_decay if callable(options.factor_decay) else float(options.factor_decay)
        self.kl_clip = options.kl_clip or None
        self.lr = lr
        self.optimizer = optimizer
        self.compute_method = options.compute_method
        self.method = make_method(options.compute_method)
        self.placement = options.placement
        self.placement_policy = make_placement(options.placement)
        self.decomposition_dtype: torch.dtype = options.torch_decomposition_dtype
        #: storage dtypes of the running factors and of the decompositions (options factor_dtype / inverse_dtype)
        self.factor_dtype: torch.dtype = options.torch_factor_dtype
        self.inverse_dtype: torch.dtype = options.torch_inverse_dtype
        self.batch_averaged = options.batch_averaged
        self.comm = communicator or TorchDistributedCommunicator()
        world = self.comm.world_size
        fraction = options.grad_worker_fraction
        #: KAISA's layout: gradient-worker groups (columns) and broadcast groups (rows) of the world
        self.grid = GradWorkerGrid(world, self.placement_policy.default_grad_workers(world) if fraction is None
                                   else grad_workers_for(fraction, world))
        #: the fraction in effect (the placement's default when the option is None)
        self.grad_worker_fraction = self.grid.grad_workers / world
        self.bucket_cap_bytes = int(options.bucket_cap_mb * 2**20)
        self.grad_scaler = grad_scaler
        #: factor-update steps whose statistics were dropped for being non-finite
        self.dropped_statistics_steps = 0

        skip_layers = options.skip_layers
        patterns = compile_skip_patterns(skip_layers)
        #: the preconditioned layers' handlers and the report of every module (:mod:`.discovery`)
        self.layer_report = find_layers(model, patterns, options.layer_types)
        self.handlers: list[LayerHandler] = self.layer_report.handlers
        if self.factor_dtype == torch.float64:  # statistics in float64 too (float32 otherwise, whatever the storage)
            for h in self.handlers:
                h.stat_dtype = torch.float64
        if not self.handlers:
            raise ValueError(
                "K-FAC found no layer with trainable weights to precondition (nn.Linear, convolutions, normalisation "
                "layers' affine parameters, embeddings)"
                + (f" after skip_layers={skip_layers!r}" if patterns else "")
                + (f" with layer_types={list(options.layer_types)!r}" if options.layer_types is not None else "")
            )
        if announce:
            self.announce_layers()

        self._by_name = {h.name: h for h in self.handlers}
        self.steps = 0
        self.epoch = 0
        self._warned: set[str] = set()
        self._forward_hooks_ran = False  # since the last step (the refusal of a forward that bypassed them)
        #: KL-clip factor nu of the last step (Eq 18), for logging
        self.last_nu = 1.0
        self._buckets = PreconditionBuckets()
        self._check_partitions()
        self.conv_input_sample_fraction = float(options.conv_input_sample_fraction)
        #: draws the A-factor sample subsets (only used when conv_input_sample_fraction < 1; saved in checkpoints)
        self.subsample_generator: torch.Generator | None = None
        if self.conv_input_sample_fraction < 1.0:
            self._enable_subsampling(int(options.subsample_seed))
        self._layout_cache: tuple[list[int], dict[tuple[int, str], int]] | None = None
        self._column_group, self._row_group = self._make_groups()
        #: the coming backward pass is the last of the optimizer step (see :meth:`no_sync`); with
        #: ``overlap_factor_allreduce`` its hooks launch the factor all-reduce
        self.final_micro_batch = True
        #: the overlapped factor all-reduce (None: reduced synchronously at the step)
        self.overlap: OverlappedFactorAllreduce | None = self._make_overlap()
        self._hooks = [
            h.module.register_forward_hook(self._make_forward_hook(i, h))
            for i, h in enumerate(self.handlers) if not h.traced
        ]
        self._hooks += [
            h.module.register_forward_pre_hook(self._make_pre_hook(h)) for h in self.handlers if h.records_input
        ]
        for i, h in enumerate(self.handlers):
            if h.traced:
                self._hooks += self._register_tracer(i, h)

    @classmethod
    def from_options(cls, model: nn.Module, options: KFACOptions, **runtime: Any) -> KFACPreconditioner:
        """The preconditioner for a ready :class:`~lightning_hpc.kfac.options.KFACOptions`; ``runtime``: ``lr``,
        ``optimizer``, ``communicator``, ``grad_scaler``, ``announce``."""
        return cls(model, **runtime, **options.as_kwargs())

    @property
    def factors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each layer's running factors by layer name (the handlers' own, :attr:`LayerHandler.factors`)."""
        return {h.name: h.factors for h in self.handlers if h.factors}

    @property
    def decompositions(self) -> dict[str, dict[str, torch.Tensor]]:
        """The decompositions this rank holds, by layer name (:attr:`LayerHandler.decompositions`)."""
        return {h.name: h.decompositions for h in self.handlers if h.decompositions}

    def _make_groups(self) -> tuple[Any, Any]:
        """This rank's gradient-worker group and broadcast group (``None``: the whole world or unused). Under
        HYBRID-OPT every rank creates every column group, then every row group, in the same order (group
        creation is collective); the communicator gives them the world's timeout."""
        grid = self.grid
        if grid.world_size == 1 or not (grid.shares_decompositions and grid.broadcasts_gradients):
            return None, None
        rank = self.comm.rank
        columns = [self.comm.new_group(grid.column(c)) for c in range(grid.num_groups)]
        rows = [self.comm.new_group(grid.row(j)) for j in range(grid.grad_workers)]
        return columns[grid.column_of(rank)], rows[grid.row_of(rank)]

    def _make_overlap(self) -> OverlappedFactorAllreduce | None:
        """The overlapped factor all-reduce when ``overlap_factor_allreduce`` is set and there is someone to talk
        to. Its buckets run on a group of their own (created here, collectively, with the world's timeout), so
        their position among the strategy's gradient all-reduces and K-FAC's other collectives, which depends on
        when each rank's hooks fire, does not matter. A communicator whose ``async_op=True`` collectives complete
        before returning (``async_collectives = False``) gets the synchronous path, with a warning."""
        if not self.options.overlap_factor_allreduce or self.comm.world_size == 1:
            return None
        gathered = [h.name for h in self.handlers if h.gathers_statistics]
        if gathered:
            # their factors need a gather over the layer's ranks at the step, which backward hooks cannot run in
            # the same order on every rank
            raise ValueError(
                f"K-FAC overlap_factor_allreduce=True: layer(s) {gathered[:5]} are sharded over ranks (hybrid_fc's "
                "fully-connected head), whose factors are gathered whole at the optimizer step; use "
                "overlap_factor_allreduce=False (the default), or skip_layers=[...] to leave them to the optimizer"
            )
        if not self.comm.async_collectives:
            warnings.warn(
                f"K-FAC overlap_factor_allreduce: {type(self.comm).__name__} has no asynchronous collectives; the "
                "factors are all-reduced synchronously at the optimizer step",
                UserWarning,
                stacklevel=3,
            )
            return None
        group = self.comm.new_group(range(self.comm.world_size))
        return OverlappedFactorAllreduce(
            self.comm, self.handlers, self.bucket_cap_bytes, self.options.symmetric_allreduce, self.batch_averaged,
            group, self._comm_device(),
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: the backward passes inside are not the step's last, so with
        ``overlap_factor_allreduce`` their hooks only accumulate statistics locally, like DDP's ``no_sync``::

            with precond.no_sync():          # and model.no_sync() under DDP
                loss_fn(model(x0), y0).backward()
            loss_fn(model(x1), y1).backward()  # launches the factor all-reduce during this backward pass
            precond.step()

        Statistics that arrive after a layer's factors were launched (accumulation without ``no_sync``) are not
        lost: the step then reduces all of them synchronously, with a warning. Without overlap it does nothing."""
        previous = self.final_micro_batch
        self.final_micro_batch = False
        try:
            yield
        finally:
            self.final_micro_batch = previous

    @property
    def skipped_modules(self) -> list[tuple[str, str, str]]:
        """``(module name, type name, reason)`` of every module with trainable parameters left to the optimizer."""
        return self.layer_report.skipped

    @property
    def preconditioned_modules(self) -> list[tuple[str, str, str]]:
        """``(module name, type name, note)`` of every preconditioned layer."""
        return self.layer_report.preconditioned

    def describe_layers(self) -> str:
        """Which modules K-FAC preconditions and which (with trainable parameters) it leaves to the optimizer."""
        return self.layer_report.describe()

    def announce_layers(self) -> None:
        """Log :meth:`describe_layers` once; warn when modules with trainable parameters are left out."""
        text = self.describe_layers()
        _log.info(text)
        if self.skipped_modules:
            warnings.warn(text, UserWarning, stacklevel=3)

    def _enable_subsampling(self, seed: int) -> None:
        tiled = [h.name for h in self.handlers if isinstance(h, TiledConvHandler)]
        if tiled:
            raise ValueError(
                f"K-FAC conv_input_sample_fraction < 1 is not supported for spatially tiled layers ({tiled[:3]}): the "
                "ranks of a spatial group would have to draw the same samples; use conv_input_sample_fraction=1.0"
            )
        self.subsample_generator = torch.Generator().manual_seed(seed)
        for h in self.handlers:
            if isinstance(h, ConvHandler):
                h.sample_fraction = self.conv_input_sample_fraction
                h.generator = self.subsample_generator

    # -- schedule ----------------------------------------------------------------------------------------
    @property
    def damping(self) -> float:
        return self.schedule.damping_at(self.epoch, self.steps)

    @property
    def factor_update_freq(self) -> int:
        return self.schedule.factor_update_freq_at(self.epoch, self.steps)

    @property
    def inv_update_freq(self) -> int:
        return self.schedule.inv_update_freq_at(self.epoch, self.steps)

    def current_factor_decay(self) -> float:
        """``factor_decay`` at the current step (a callable of the step is called)."""
        return float(value_at("factor_decay", self.factor_decay, self.steps, lambda v: 0.0 <= v < 1.0, "in [0, 1)"))

    def current_kl_clip(self) -> float | None:
        """``kl_clip`` at the current step (None or 0: disabled)."""
        if self.kl_clip is None:
            return None
        return float(value_at("kl_clip", self.kl_clip, self.steps, lambda v: v is not None and v >= 0, ">= 0")) or None

    def set_epoch(self, epoch: int) -> None:
        """Apply the epoch schedules (damping decay, update-frequency decay); call at each epoch start."""
        self.epoch = int(epoch)

    @property
    def is_factor_update_step(self) -> bool:
        return self.steps % self.factor_update_freq == 0

    @property
    def is_inv_update_step(self) -> bool:
        return self.steps % self.inv_update_freq == 0

    def _check_partitions(self) -> None:
        """Spatially tiled layers (:class:`~lightning_hpc.kfac.layers.TiledConvHandler`) hold partial factors
        over ``partition_size`` ranks: the world must consist of whole groups of that size, all of one size."""
        sizes = {h.partition_size for h in self.handlers if h.partition_size > 1}
        if not sizes:
            return
        world = self.comm.world_size
        if len(sizes) > 1 or world % next(iter(sizes)) != 0:
            raise ValueError(
                f"K-FAC: the model's spatially partitioned layers split each sample over {sorted(sizes)} ranks, which "
                f"does not fit the communicator's world of {world} ranks (it must be sample groups x one spatial "
                "group size); declare the model's convolutions with one spatial grid (spatial_parts) whose size "
                "divides the world size, and give K-FAC the world communicator"
            )

    # -- hooks -------------------------------------------------------------------------------------------
    def _capturing(self, module: nn.Module) -> bool:
        # Only training forwards that will be backpropagated, and only on factor-update steps:
        # validation, no-grad and inference-mode forwards never touch the factors.
        return module.training and torch.is_grad_enabled() and self.is_factor_update_step

    def _check_module(self, handler: LayerHandler, module: nn.Module) -> None:
        if module is not handler.module:
            # The hook runs on another module than its handler's (a layer replaced by one that took over its hook
            # dict, or a copy of the model made after the hooks were registered): its statistics would be
            # recorded for the wrong layer.
            raise RuntimeError(
                f"K-FAC layer {handler.name!r}: its hooks ran on another {type(module).__name__} than the one they "
                "were registered on (a layer replaced, or the model copied, after the K-FAC hooks were registered); "
                "create the KFACPreconditioner for the model that trains, after any change to its layers"
            )

    def _make_pre_hook(self, handler: LayerHandler) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            self._check_module(handler, module)
            handler.prepare_capture(self._capturing(module))

        return hook

    def _output_grad_hook(self, index: int, handler: LayerHandler, token: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:  # returns None: the gradient itself is never replaced
            committed = handler.capture_output_grad(g, token)
            overlap = self.overlap
            if committed and overlap is not None and self.final_micro_batch:
                overlap.armed = True
                # final once every call of the layer in this forward pass has its output gradient (a shared
                # layer's hook fires once per call)
                if not handler.awaiting_output_grads():
                    overlap.layer_done(index)

        return hook

    def _make_forward_hook(self, index: int, handler: LayerHandler) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            self._forward_hooks_ran = True  # (capturing or not: an eval-mode or no-grad forward ran the hooks too)
            self._check_module(handler, module)
            x = handler.captured_input(inputs)  # also ends the layer's recording when it records its input
            self._capture(index, handler, module, x, output)

        return hook

    def _register_tracer(self, index: int, handler: LayerHandler) -> list[Any]:
        """The hooks of a subclass with its own forward (:mod:`.subclasses`): a :class:`CallTracer` follows each
        forward that builds a graph, captures the calls of its base class's op on its weight, and leaves the layer to
        the optimizer when the weight reaches the result any other way."""
        module = handler.module
        op = FUNCTIONAL_OPS[base_type(module)]  # type: ignore[index]  # discovery traces these types only

        def on_call(x: torch.Tensor, output: torch.Tensor, geometry: ConvGeometry | None) -> None:
            if handler.left_out is not None:
                return
            if isinstance(handler, ConvHandler):
                handler.call_geometry = geometry  # the call's padding, stride and dilation: A of what it convolves
            try:
                self._capture(index, handler, module, x, output)
            finally:
                if isinstance(handler, ConvHandler):
                    handler.call_geometry = None

        tracer = CallTracer(module, op, on_call)

        def pre_hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            self._check_module(handler, module)
            if handler.left_out is None and torch.is_grad_enabled():
                tracer.start()

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            self._forward_hooks_ran = True
            used, reason = tracer.finish(output)
            if reason is not None:
                self._leave_out(handler, reason)
            elif used and handler.left_out is None:
                self.layer_report.settle(handler.name, None)

        return [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(hook, always_call=True)]

    def _leave_out(self, handler: LayerHandler, reason: str) -> None:
        """Leave a traced layer to the optimizer from now on: it is reported with ``reason``, said once, and keeps
        no statistics, factors or decompositions (so :meth:`step` no longer changes its gradient)."""
        if handler.left_out is not None:
            return
        handler.left_out = reason
        handler.reset_statistics()
        handler.factors, handler.decompositions = {}, {}
        self.layer_report.settle(handler.name, reason)
        self._warn_once(f"left_out:{handler.name}", f"K-FAC leaves layer {handler.name!r} "
                        f"({type(handler.module).__name__}) to the optimizer: {reason}", stacklevel=4)

    def _capture(self, index: int, handler: LayerHandler, module: nn.Module, x: torch.Tensor | None,
                 output: Any) -> None:
        """Capture one call of the layer: ``x`` is what A is formed from, ``output`` the tensor whose gradient
        forms G (the module's, or the traced functional call's)."""
        if not self._capturing(module):
            return
        if x is None or not isinstance(output, torch.Tensor) or not output.requires_grad or not handler.captures(x):
            return
        if handler.is_stale():
            # statistics of a backward pass whose step() never ran (gradients cleared since): drop them all
            if self.overlap is not None:
                self.overlap.abandon()  # and whatever that backward pass launched
            for h in self.handlers:
                h.discard_committed()
        token = handler.capture_input(x)
        # the raw gradient of this tensor, also for a tensor subclass that would wrap it for user hooks (a
        # spatial tile: the tiled handler expects the tile's own part)
        with torch._C.DisableTorchFunctionSubclass():
            output.register_hook(self._output_grad_hook(index, handler, token))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def discard_statistics(self) -> None:
        """Drop what the hooks captured since the last step (an AMP step skipped for inf/nan gradients)."""
        if self.overlap is not None:
            self.overlap.abandon()
        for h in self.handlers:
            h.reset_statistics()
        self._forward_hooks_ran = False

    # -- step --------------------------------------------------------------------------------------------
    def _resolve_grad_scale(self, grad_scale: float | None) -> float:
        """The loss scale the captured output gradients carry: ``grad_scale`` if given, else the ``grad_scaler``'s
        current scale, else 1 -- refused when float16 output gradients were captured with neither (AMP's scale
        would enter G squared and make every update near zero)."""
        if grad_scale is not None:
            return float(grad_scale)
        if self.grad_scaler is not None:
            return float(self.grad_scaler.get_scale()) if self.grad_scaler.is_enabled() else 1.0
        if self.is_factor_update_step and any(h.g_dtype == torch.float16 for h in self.handlers):
            raise ValueError(
                "K-FAC captured float16 output gradients but was not told the loss scale they carry: pass "
                "KFACPreconditioner(..., grad_scaler=scaler), or call step(grad_scale=scaler.get_scale()) after "
                "scaler.unscale_(optimizer) (grad_scale=1.0 for float16 without a GradScaler)"
            )
        return 1.0

    @torch.no_grad()
    def step(self, lr: float | None = None, grad_scale: float | None = None) -> None:
        """Precondition ``.grad`` of every registered layer in place (after the gradient allreduce).

        ``grad_scale`` is the AMP loss scale the captured output gradients carry (default: the ``grad_scaler``'s
        scale, else 1; required when float16 output gradients were captured without a ``grad_scaler``).
        """
        if all(h.module.weight.grad is None for h in self.handlers):
            # No gradient at all (a training_step that returned None, a loss that did not reach these layers):
            # the optimizer step does nothing, so neither does K-FAC; the step does not count.
            self.discard_statistics()
            return
        try:
            scale = self._resolve_grad_scale(grad_scale)
            if self.is_factor_update_step:
                self._note_shared_layers()
                self._update_factors(scale)
            if self.is_inv_update_step or self._missing_decompositions():
                self._update_decompositions()
            self._precondition(lr)
        finally:
            self.discard_statistics()
            self.steps += 1

    def _note_shared_layers(self) -> None:
        """One note, the first time, for layers called more than once per forward pass."""
        shared = [
            (h.name, h.max_calls_per_forward)
            for h in self.handlers
            if h.max_calls_per_forward > 1 and f"calls:{h.name}" not in self._warned
        ]
        if not shared:
            return
        self._warned.update(f"calls:{name}" for name, _ in shared)
        warnings.warn(
            f"K-FAC: layer(s) called more than once per forward pass {shared[:5]} (name, calls): each is treated as "
            "one layer applied at several positions (KFC's weight sharing): samples are counted once per forward "
            "pass, every call's inputs are rows of A, so G equals a single call on the calls' inputs stacked along "
            "a position dimension",
            UserWarning,
            stacklevel=4,
        )

    def _missing_decompositions(self) -> bool:
        """Layers with factors but no decomposition on a rank that must hold it (hooks that fired late, a
        checkpoint restored with a gradient-worker fraction below 1): decomposed at once rather than at the next
        interval. Every rank reaches the same answer, because factors and shared decompositions are identical
        and a layer's gradient workers hold the same decompositions."""
        mine = [h for i, h in enumerate(self.handlers) if self._is_worker(i)]
        return any(h.factors and not h.decompositions for h in mine)

    # factors ----------------------------------------------------------------------------------------------
    def _update_factors(self, grad_scale: float) -> None:
        batch: dict[LayerHandler, dict[str, torch.Tensor]] | None = None
        if self.overlap is not None:
            result = self.overlap.finish(grad_scale)
            if result is None:
                self._warn_once(
                    "late",
                    "K-FAC overlap_factor_allreduce: statistics were captured after a layer's factors had been "
                    "launched (gradient accumulation without KFACPreconditioner.no_sync() on the earlier "
                    "micro-batches); this step's factors are reduced again, synchronously, from all of them",
                )
            else:
                fired, reduced = result
                self._active_layers(fired)  # warns about layers that did not fire on every rank
                batch = {self.handlers[i]: reduced[i] for i in sorted(reduced)}
        if batch is None:
            batch = self._reduce_factors(grad_scale)
        self._fold_factors(batch)

    def _warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        """A RuntimeWarning the first time ``key`` comes up (``stacklevel`` counted from the caller)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)

    def _active_layers(self, fired: list[float]) -> list[LayerHandler]:
        """The layers whose hooks fired on every rank (``fired``: the fraction of ranks, per layer); one warning
        for each other layer, the first time."""
        if self.handlers and not any(f > 0 for f in fired) and not self._forward_hooks_ran:
            # No layer captured anything on any rank and no forward hook ran here since the last step, though the
            # step has gradients: the forward bypassed the hooks (an eval-mode forward runs them and is only
            # warned about below).  Ranks run the same code, so every rank refuses at this factor step, before
            # the optimizer's update.
            raise RuntimeError(
                f"K-FAC: none of the hooks of the {len(self.handlers)} layers it preconditions fired in a training "
                "step whose gradients reached them: the forward ran code that does not call the modules' hooks. "
                "The usual cause is torch.compile reusing code it compiled for the same module class before K-FAC "
                "registered its hooks (compiled code is not guarded on hooks added to another instance); call "
                "torch._dynamo.reset() before training the compiled model under K-FAC"
            )
        active: list[LayerHandler] = []
        for h, f in zip(self.handlers, fired):
            if f >= 1.0 - 1e-6:
                active.append(h)
            elif h.left_out is None:  # (a layer left out since setup was said to be when it was)
                self._warn_once(
                    h.name,
                    f"K-FAC: the hooks of layer {h.name!r} ({type(h.module).__name__}) did not fire in a training "
                    "step on every rank (used functionally, output unused, or shared oddly); its factors are not "
                    "updated and its gradient is left to the optimizer until they exist",
                    stacklevel=4,
                )
        return active

    def _reduce_factors(self, grad_scale: float) -> dict[LayerHandler, dict[str, torch.Tensor]]:
        """The batch factors of the layers whose hooks fired on every rank, averaged over the ranks at the step
        (the synchronous path: all buckets in flight at once, after the backward pass)."""
        fired = torch.tensor([1.0 if h.has_statistics else 0.0 for h in self.handlers])
        if self.comm.world_size > 1:
            # A layer is updated only if its hooks fired on every rank, so the factor allreduce matches.
            device = self._comm_device()
            fired = fired.to(device)
            self.comm.allreduce(fired, op="sum").wait()
            fired = fired.cpu() / self.comm.world_size
        active = self._active_layers(fired.tolist())
        batch = {h: h.batch_statistics(grad_scale, self.batch_averaged) for h in active}
        if self.comm.world_size > 1:
            # each layer's factors packed by their forms (tiled layers' partial factors scaled to sums over their
            # spatial group); replicated layers (heads after global pooling) hold the same factor on every rank of
            # a spatial group: the plain world mean counts each group once
            symmetric = self.options.symmetric_allreduce
            packed = {h: h.pack_factors(f, symmetric) for h, f in batch.items()}
            allreduce_mean(self.comm, list(packed.values()), self.bucket_cap_bytes)
            batch = {h: h.unpack_factors(v, symmetric) for h, v in packed.items()}
        return batch

    def _fold_factors(self, batch: dict[LayerHandler, dict[str, torch.Tensor]]) -> None:
        """Fold the averaged batch factors into each layer's running averages (Eq 16-17), unless any is
        non-finite."""
        if batch and not self._all_finite([t for factors in batch.values() for t in factors.values()]):
            # A NaN / Inf statistic on any rank is non-finite in the averaged factors on every rank, so every rank
            # drops the same step. Folded in, it would stay in the running averages for the rest of the run.
            self.dropped_statistics_steps += 1
            bad = [h.name for h, factors in batch.items() if not self._all_finite(list(factors.values()))]
            self._warn_once(
                "nonfinite",
                f"K-FAC: non-finite factor statistics in step {self.steps} (layers {bad[:5]}); this step's "
                "statistics are dropped and the running factors kept (said once; dropped_statistics_steps "
                "counts them)",
                stacklevel=4,
            )
            return
        decay = self.current_factor_decay()
        for h, factors in batch.items():
            h.fold(factors, decay, self.factor_dtype)

    @staticmethod
    def _all_finite(tensors: list[torch.Tensor]) -> bool:
        # one host synchronisation for all layers
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())

    def _comm_device(self) -> torch.device:
        # NCCL needs CUDA tensors; gloo takes CPU ones. The layers' device is the right one in both cases.
        return self.handlers[0].weight.device

    # decompositions -------------------------------------------------------------------------------------
    def _layout(self) -> tuple[list[int], dict[tuple[int, str], int]]:
        if self._layout_cache is None:  # deterministic in the layer shapes and the grid: computed once
            dims = [h.layer_forms() for h in self.handlers]
            self._layout_cache = self.placement_policy.assign_grid(dims, self.grid)
        return self._layout_cache

    def assignment(self) -> dict[tuple[int, str], int]:
        """``(layer index, factor name) -> rank`` that decomposes each factor (within the layer's worker group)."""
        return self._layout()[1]

    def layer_columns(self) -> list[int]:
        """The gradient-worker group (column of :attr:`grid`) of each layer."""
        return self._layout()[0]

    def _is_worker(self, i: int) -> bool:
        """This rank holds layer ``i``'s decompositions and preconditions its gradient."""
        return self.grid.column_of(self.comm.rank) == self.layer_columns()[i]

    def _update_decompositions(self) -> None:
        world, rank = self.comm.world_size, self.comm.rank
        owners = self.assignment()
        # only the layers of this rank's gradient-worker group
        work = [(owners[(i, kind)], h, kind) for i, h in enumerate(self.handlers) if h.factors and self._is_worker(i)
                for kind in h.factor_forms()]  # fmt: skip
        # Step 2 of Algorithm 1: each rank decomposes the factors assigned to it, as the factor's form says.
        results: dict[tuple[str, str], dict[str, torch.Tensor]] = {
            (h.name, kind): h.decompose(kind, self.method, self.damping, self.decomposition_dtype, self.inverse_dtype)
            for owner, h, kind in work if owner == rank
        }  # fmt: skip
        if world > 1 and self.grid.shares_decompositions:
            # to the other gradient workers of the layer (KAISA: the column; COMM-OPT: the world)
            results = self._share(work, results, self._column_group)
        for (name, kind), res in results.items():
            self._by_name[name].set_decomposition(kind, res)

    def _share(self, work: list[tuple[int, LayerHandler, str]], results: dict[tuple[str, str], dict[str, torch.Tensor]],
               group: Any = None) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
        """One broadcast per owning rank of all its decompositions within ``group`` (None: the world), all in
        flight at once (paper: allgather)."""
        items: dict[int, list[tuple[Hashable, dict[str, tuple[int, ...]]]]] = {}
        for owner, h, kind in work:
            items.setdefault(owner, []).append(((h.name, kind), h.result_shapes(kind, self.method)))
        return broadcast_by_owner(  # type: ignore[return-value]
            self.comm, items, results, self.inverse_dtype, self._comm_device(), group  # type: ignore[arg-type]
        )

    # preconditioning ------------------------------------------------------------------------------------
    def _precondition_layers(self, handlers: Sequence[LayerHandler],
                             grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The preconditioned gradients of ``handlers`` (each with decompositions), bucket by bucket
        (:mod:`lightning_hpc.kfac.batched`), their exactly-zero rows and columns kept zero."""
        return self._buckets.precondition(handlers, grads, self.method, self.damping, self.decomposition_dtype)

    def _layer_lrs(self, lr: float | None) -> Callable[[LayerHandler], float | None]:
        """Each layer's learning rate for Eq 18: ``lr`` when given, else the lr of the first optimizer parameter
        group holding the layer's weight, else the preconditioner's ``lr`` (None: none known). The groups are
        indexed once per step: searching them for every layer cost as much as a fifth of a preconditioning step."""
        if lr is not None:
            return lambda h: float(lr)
        by_param: dict[int, float] = {}
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            for p in group["params"]:
                by_param.setdefault(id(p), float(group["lr"]))
        default = None if self.lr is None else float(self.lr() if callable(self.lr) else self.lr)
        return lambda h: by_param.get(id(h.module.weight), default)

    def _precondition(self, lr: float | None) -> None:
        world = self.comm.world_size
        grads: dict[str, torch.Tensor] = {}
        for h in self.handlers:
            g = h.grad_matrix()
            if g is not None and h.factors:
                grads[h.name] = g
        if world > 1 and self.grid.broadcasts_gradients:
            precond = self._precondition_by_workers(grads)
        else:
            precond = self._precondition_layers([h for h in self.handlers if h.name in grads and h.decompositions],
                                                grads)
        if not precond:
            return
        nu = 1.0
        kl_clip = self.current_kl_clip()
        if kl_clip:
            # Eq 18: nu = min(1, sqrt(kappa / (alpha^2 sum_i |P_i . grad_i|))), alpha the layer's current lr; the
            # per-layer products stay on the device and are summed there: one host sync per step, not per layer
            lr_of = self._layer_lrs(lr)
            terms: list[torch.Tensor] = []
            lr_squares: list[float] = []
            for h in self.handlers:
                if h.name not in precond:
                    continue
                layer_lr = lr_of(h)
                if layer_lr is None:
                    where = (f": the weight of layer {h.name!r} is in none of the optimizer's parameter groups"
                             if self.optimizer is not None else "")
                    raise ValueError(
                        f"K-FAC kl_clip needs the learning rate{where}; pass the optimizer that trains every "
                        "preconditioned layer as optimizer= (or lr=) to KFACPreconditioner, or lr= to step()"
                    )
                p = precond[h.name]
                terms.append((p * grads[h.name].to(p.dtype)).sum())
                lr_squares.append(layer_lr**2)
            # summed in float64, as the per-layer Python floats were
            vg_sum = float((torch.stack(terms).to(torch.float64).abs() * torch.tensor(
                lr_squares, dtype=torch.float64, device=terms[0].device)).sum()) if terms else 0.0
            if vg_sum > 0:
                nu = min(1.0, math.sqrt(kl_clip / vg_sum))
        self.last_nu = nu
        for h in self.handlers:
            if h.name in precond:
                p = precond[h.name]
                h.set_grad_matrix(p * nu if nu != 1.0 else p)

    def _precondition_by_workers(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """KAISA (SC21; K-FAC-lw at one worker per layer): in each broadcast group (row), the member of a
        layer's worker group preconditions the layer and broadcasts the result to the row (one buffer per source)."""
        columns = self.layer_columns()
        rank = self.comm.rank
        items: dict[int, list[tuple[Hashable, dict[str, tuple[int, ...]]]]] = {}
        local: dict[Hashable, dict[str, torch.Tensor]] = {}
        mine: list[LayerHandler] = []
        for i, h in enumerate(self.handlers):
            # Identical on every rank: gradients are allreduced and factors exist everywhere by now.
            if h.name not in grads:
                continue
            source = self.grid.source(columns[i], rank)
            items.setdefault(source, []).append((h.name, {"p": tuple(grads[h.name].shape)}))
            if source == rank:
                if h.decompositions:
                    mine.append(h)
                else:  # decomposition failed to exist: plain gradient, as the other layers' optimizer sees it
                    local[h.name] = {"p": grads[h.name]}
        local.update({name: {"p": p} for name, p in self._precondition_layers(mine, grads).items()})
        out = broadcast_by_owner(
            self.comm, items, local, self.decomposition_dtype, self._comm_device(), self._row_group
        )
        return {name: res["p"] for name, res in out.items()}  # type: ignore[misc]

    # -- checkpointing -----------------------------------------------------------------------------------
    def _sharded(self) -> bool:
        """With a gradient-worker fraction below 1 (e.g. multi-rank ``layer_wise``) each rank holds only the
        decompositions of the layers of its gradient-worker group."""
        return self.grid.broadcasts_gradients and self.comm.world_size > 1

    def _owned_decompositions(self) -> dict[str, dict[str, torch.Tensor]]:
        return {h.name: h.decompositions for i, h in enumerate(self.handlers)
                if self._is_worker(i) and h.decompositions}  # fmt: skip

    def _gather_decompositions(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every layer's decompositions on every rank (collective): when they are sharded the owners broadcast
        theirs (one buffer per owner, as :meth:`_share`), so a checkpoint written by rank 0 lets every rank
        resume with the decompositions it had, instead of recomputing them from newer factors."""
        owned = self._owned_decompositions()
        owners = self.assignment()
        rank = self.comm.rank
        # counted once per layer: by the rank that decomposes its first factor (a member of its worker group)
        present = torch.tensor(
            [1.0 if h.name in owned and owners[(i, next(iter(h.factor_forms())))] == rank else 0.0
             for i, h in enumerate(self.handlers)],
            device=self._comm_device(),
        )
        self.comm.allreduce(present, op="sum").wait()  # which layers have a decomposition on their owner
        work = [
            (owners[(i, kind)], h, kind)
            for i, h in enumerate(self.handlers)
            if present[i].item() > 0
            for kind in h.factor_forms()
        ]
        mine = {(h.name, kind): h.decomposition_of(kind, self.method) for owner, h, kind in work if owner == rank}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (name, kind), res in self._share(work, mine).items():
            for k, v in res.items():
                out.setdefault(name, {})[f"{k}_{kind}"] = v
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counters, running factors and every layer's decompositions, so a resumed run continues bitwise.

        With a gradient-worker fraction below 1 (multi-rank ``layer_wise`` by default) the decompositions are
        sharded across ranks; this method then gathers them and is a collective: call it on every rank
        (Lightning's checkpointing does), before rank 0 writes.
        """
        decompositions = self._gather_decompositions() if self._sharded() else self.decompositions
        extra = {} if self.subsample_generator is None else {"subsample_rng": self.subsample_generator.get_state()}
        return {
            **extra,
            "steps": self.steps,
            "epoch": self.epoch,
            "compute_method": self.compute_method,
            "factors": {n: {k: v.detach().clone() for k, v in f.items()} for n, f in self.factors.items()},
            "decompositions": {n: {k: v.detach().clone() for k, v in d.items()} for n, d in decompositions.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the same checkpoint on every rank). With a gradient-worker
        fraction below 1 each rank keeps only its worker group's decompositions; decompositions missing from an older
        checkpoint are recomputed from the saved factors at the next step (then not bitwise)."""
        state = self._stack_group_entries(state)
        unknown = sorted(set(state.get("factors", {})) - set(self._by_name))
        if unknown:
            raise ValueError(f"K-FAC checkpoint has factors for layers this model does not register: {unknown[:5]}")
        self.steps = int(state["steps"])
        self.epoch = int(state.get("epoch", 0))
        if self.subsample_generator is not None and "subsample_rng" in state:
            self.subsample_generator.set_state(state["subsample_rng"])
        same_method = state.get("compute_method", self.compute_method) == self.compute_method
        saved = state.get("decompositions", {}) if same_method else {}
        for i, h in enumerate(self.handlers):
            # with a gradient-worker fraction below 1 a rank keeps only its worker group's decompositions
            keep = h.name in saved and (not self._sharded() or self._is_worker(i))
            h.load_state(state["factors"].get(h.name, {}), saved[h.name] if keep else {}, self.factor_dtype,
                         self.inverse_dtype)

    def _stack_group_entries(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the entries of a checkpoint that kept each group of a grouped convolution as a layer of
        its own (``<layer>#g<i>``, one block each) stacked into the layer's ``(groups, ...)`` factors and
        decompositions: the same blocks in the layout :class:`~.layers.GroupConvHandler` keeps. A layer with only
        some of its groups' entries, or with entries of both layouts, is refused."""
        sections = {key: dict(state.get(key, {})) for key in ("factors", "decompositions")}
        for h in self.handlers:
            if h.groups == 1:
                continue
            names = [f"{h.name}#g{i}" for i in range(h.groups)]
            for key, section in sections.items():
                found = [n for n in names if n in section]
                if not found:
                    continue
                parts = [section.pop(n, None) for n in names]
                keys = {tuple(sorted(p)) for p in parts if p is not None}
                if len(found) != len(names) or h.name in section or len(keys) != 1:
                    raise ValueError(
                        f"K-FAC checkpoint: the {key} of grouped layer {h.name!r} are neither one entry nor one "
                        f"'{h.name}#g<i>' entry with the same tensors for each of its {h.groups} groups (found "
                        f"{found[:5]}{' and the whole layer' if h.name in section else ''}); it was written for "
                        "another model"
                    )
                section[h.name] = {k: torch.stack([p[k] for p in parts if p is not None]) for k in next(iter(keys))}
        return {**state, **sections}

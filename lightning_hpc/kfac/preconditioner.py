"""``KFACPreconditioner``: the distributed K-FAC gradient preconditioner of Pauloski et al. (SC20), plain torch.

Usage (paper Listing 1)::

    precond = KFACPreconditioner(model, optimizer=optimizer, damping=0.003, inv_update_freq=10)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()      # gradients averaged across ranks (DDP / strategy) by now
        precond.step()                       # rewrites .grad of every Linear / ConvNd in place
        optimizer.step()                     # any torch optimizer

Per optimizer step (Algorithm 1):

1. On factor-update steps (every ``factor_update_freq``), forward/backward hooks (:mod:`.hooks`) capture layer
   inputs and output gradients of every micro-batch; ``step`` forms the batch factors (:mod:`.factor_update`; see
   :mod:`.layers` for the scaling), averages them across ranks (asynchronous, bucketed allreduce; with
   ``overlap_factor_allreduce`` launched from the backward hooks of the step's last micro-batch, overlapping the
   rest of the backward pass as in KAISA, SC21: :mod:`.overlap`) and folds them into the running averages
   (Eq 16-17; ``factor_decay`` is the weight of the old average, as in the SC20 code and its range [0.9, 1)).
   Layers tiled by spatial parallelism (:class:`~lightning_hpc.kfac.layers.TiledConvHandler`) hold partial
   factors: summed over their spatial group, averaged over sample groups, in the same allreduce.
2. On decomposition steps (every ``inv_update_freq``), each factor is decomposed once, on the rank chosen by
   ``placement`` (:mod:`.placement`), in float32 (or float64), those of one side length by one batched solver
   (:mod:`.batched_decompositions`), and shared with the layer's gradient workers by one broadcast per owning rank.
   ``compute_method="eigen"`` stores eigenpairs (Eq 13-15), ``"inverse"`` damped inverses (Eq 11).
3. Every step, each layer's gradient is preconditioned by its gradient workers (KAISA's ``grad_worker_fraction``,
   SC21, arXiv:2107.01739: all ranks at fraction 1, the default except under ``layer_wise``; one owner at ``1 / world``,
   K-FAC-lw), who broadcast the result to the other ranks of their broadcast group; it is then scaled by the
   KL-clip factor of Eq 18 (:mod:`.kl_clip`) and written back into ``.grad``.

Steps that update neither factors nor decompositions communicate nothing when every rank is a gradient worker
of every layer (``grad_worker_fraction=1``).
All collectives go through a :class:`~lightning_hpc.distributed.comm.Communicator`, so the Horovod backend
can be swapped in. Checkpoints are :mod:`.checkpoint`'s; the settings one :class:`~.options.KFACOptions`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator
from lightning_hpc.kfac import checkpoint, worker_groups
from lightning_hpc.kfac.batched import PreconditionBuckets
from lightning_hpc.kfac.discovery import find_layers
from lightning_hpc.kfac.factor_update import (
    check_partitions,
    enable_subsampling,
    note_shared_layers,
    resolve_grad_scale,
    update_factors,
)
from lightning_hpc.kfac.hooks import CaptureHooks
from lightning_hpc.kfac.kl_clip import LayerLearningRates, kl_clip_factor
from lightning_hpc.kfac.layers import LayerHandler
from lightning_hpc.kfac.layers.state import generation
from lightning_hpc.kfac.methods import COMPUTE_METHODS, make_method
from lightning_hpc.kfac.options import KFACOptions, compile_skip_patterns, with_option_keywords
from lightning_hpc.kfac.overlap import OverlappedFactorAllreduce, make_overlap
from lightning_hpc.kfac.placement import GradWorkerGrid, grad_workers_for, make_placement
from lightning_hpc.kfac.schedules import SpreadDecompositions, value_at
from lightning_hpc.protocols import TiledLayers

__all__ = ["COMPUTE_METHODS", "KFACPreconditioner"]

_log = logging.getLogger("lightning_hpc.kfac")


class KFACPreconditioner:
    """Preconditions the gradients of a model's layers with K-FAC (SC20 Alg. 1): the loop of the module docstring.

    What each layer type computes is its handler's (:mod:`.layers`); the hooks are :mod:`.hooks`, the factor update
    :mod:`.factor_update`, the KL clip :mod:`.kl_clip`, checkpoints :mod:`.checkpoint`. The decomposition and
    preconditioning rules are a :class:`~lightning_hpc.kfac.methods.ComputeMethod` (``self.method``: Eq 13-15 or
    Eq 11-12); which rank decomposes what, and who preconditions, a :class:`~lightning_hpc.kfac.placement.Placement`
    (``self.placement_policy``).

    Args:
        model: the module whose layers are preconditioned (every other parameter is untouched).
        options: the hyper-parameters, a :class:`~lightning_hpc.kfac.options.KFACOptions` (documented and validated
            there); the keyword arguments named like its fields override them (``KFACPreconditioner(model,
            damping=0.003)``; the signature lists them, derived from ``KFACOptions``).
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
        tiled_layers: the layers a spatial strategy runs on tiles of each sample
            (:class:`~lightning_hpc.protocols.TiledLayers`, e.g. the spatial strategy's
            :class:`~lightning_hpc.spatial.dispatch.kfac_contract.TiledLayerRegistry`; the Lightning callback passes the
            strategy's ``kfac_tiled_layers``): their factors are partial sums over the tiles.
        parameters: with several optimizers (a GAN's generator and discriminator), the parameters of the one this
            preconditioner serves: only the layers whose trainable parameters are among them are preconditioned, and
            :meth:`step` is called before that optimizer's step. One preconditioner per optimizer (a layer that another
            preconditioner already hooks is refused: their ``parameters`` must not overlap); a layer's
            statistics are those of the backward passes that give its weight a gradient (not those with the layer
            frozen, as ``toggle_optimizer`` freezes it) since its optimizer's gradients were last cleared (the
            discriminator's factors leave out the generator step's pass through it once ``zero_grad`` cleared the
            gradients it left). None (default): every layer of ``model``.
    """

    @with_option_keywords
    def __init__(
        self,
        model: nn.Module,
        options: KFACOptions | None = None,
        *,
        lr: float | Callable[[], float] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        communicator: Communicator | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        announce: bool = True,
        tiled_layers: TiledLayers | None = None,
        parameters: Iterable[torch.Tensor] | None = None,
        **option_fields: Any,
    ) -> None:
        options = options or KFACOptions()
        options = options.replace(**option_fields) if option_fields else options
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

        patterns = compile_skip_patterns(options.skip_layers)
        #: the preconditioned layers' handlers and the report of every module (:mod:`.discovery`)
        owned = None if parameters is None else {id(p) for p in parameters}
        #: serves one of several optimizers (``parameters`` given): a layer's statistics also end at a ``zero_grad``
        #: between a backward pass's forward and its output gradient (:meth:`LayerHandler.stale_before`), the order of
        #: a GAN's steps, where the other optimizer's step left statistics and gradients through its layers
        self.one_of_several = owned is not None
        self.layer_report = find_layers(model, patterns, options.layer_types, tiled_layers, owned)
        self.handlers: list[LayerHandler] = self.layer_report.handlers
        if self.factor_dtype == torch.float64:  # statistics in float64 too (float32 otherwise, whatever the storage)
            for h in self.handlers:
                h.stat_dtype = torch.float64
        if not self.handlers:
            raise ValueError(
                "K-FAC found no layer with trainable weights to precondition (nn.Linear, convolutions, normalisation "
                "layers' affine parameters, embeddings)"
                + (f" after skip_layers={options.skip_layers!r}" if patterns else "")
                + (f" with layer_types={list(options.layer_types)!r}" if options.layer_types is not None else "")
                + (" among the given parameters" if owned is not None else "")
            )
        if announce:
            self.announce_layers()

        self._by_name = {h.name: h for h in self.handlers}
        self.steps = 0
        self.epoch = 0
        #: keys of the one-time warnings already given (:meth:`warn_once`)
        self.warned: set[str] = set()
        #: KL-clip factor nu of the last step (Eq 18) on the device; None: nothing was clipped (see :attr:`last_nu`)
        self._last_nu: torch.Tensor | None = None
        self._buckets = PreconditionBuckets()
        self._lrs = LayerLearningRates()
        self._complete_at = -1  # the generation at which no layer missed its decompositions
        #: the layers' weights (re-read on factor-update steps: ``module.weight`` is a Python call per layer)
        self._weights = [h.weight for h in self.handlers]
        check_partitions(self.handlers, world)
        self.conv_input_sample_fraction = float(options.conv_input_sample_fraction)
        #: draws the A-factor sample subsets (only used when conv_input_sample_fraction < 1; saved in checkpoints)
        self.subsample_generator = enable_subsampling(self.handlers, self.conv_input_sample_fraction,
                                                      int(options.subsample_seed))
        self._layout_cache: tuple[list[int], dict[tuple[int, str], int]] | None = None
        self._spread = SpreadDecompositions()  # the phases of spread_decompositions
        self._column_group, self._row_group = self.grid.make_groups(self.comm)
        #: the coming backward pass is the last of the optimizer step (see :meth:`no_sync`); with
        #: ``overlap_factor_allreduce`` its hooks launch the factor all-reduce
        self.final_micro_batch = True
        #: the overlapped factor all-reduce (None: reduced synchronously at the step)
        self.overlap: OverlappedFactorAllreduce | None = make_overlap(self, stacklevel=3)
        if owned is not None:  # one of several optimizers' preconditioners: each layer is one's alone
            CaptureHooks.refuse_hooked_layers(self.handlers)
        self._hooks = CaptureHooks(self)

    @classmethod
    def from_options(cls, model: nn.Module, options: KFACOptions, **runtime: Any) -> KFACPreconditioner:
        """The preconditioner for a ready :class:`~.options.KFACOptions`; ``runtime``: the keyword arguments."""
        return cls(model, options, **runtime)

    @property
    def factors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each layer's running factors by layer name (the handlers' own, :attr:`LayerHandler.factors`)."""
        return {h.name: h.factors for h in self.handlers if h.factors}

    @property
    def decompositions(self) -> dict[str, dict[str, torch.Tensor]]:
        """The decompositions this rank holds, by layer name (:attr:`LayerHandler.decompositions`)."""
        return {h.name: h.decompositions for h in self.handlers if h.decompositions}

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

    def warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        """A RuntimeWarning the first time ``key`` comes up (``stacklevel`` counted from the caller)."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)

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

    @property
    def last_nu(self) -> float:
        """The KL-clip factor nu of the last step (Eq 18), for logging: reading it waits for the device (the step
        itself never does)."""
        return 1.0 if self._last_nu is None else float(self._last_nu)

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

    # -- hooks -------------------------------------------------------------------------------------------
    @property
    def capture_hooks(self) -> CaptureHooks:
        """The hooks that capture the statistics (:mod:`.compiled` idles them around a compiled forward)."""
        return self._hooks

    def remove_hooks(self) -> None:
        self._hooks.remove()

    def discard_statistics(self) -> None:
        """Drop what the hooks captured since the last step (an AMP step skipped for inf/nan gradients); layer by
        layer only when they captured anything since the last time (a step that only preconditions: nothing)."""
        if self.overlap is not None:
            self.overlap.abandon()
        if self._hooks.captured:
            for h in self.handlers:
                h.reset_statistics()
        self._hooks.captured = self._hooks.forward_hooks_ran = False

    # -- step --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float | None = None, grad_scale: float | None = None) -> None:
        """Precondition ``.grad`` of every registered layer in place (after the gradient allreduce).

        ``grad_scale`` is the AMP loss scale the captured output gradients carry (default: the ``grad_scaler``'s
        scale, else 1; required when float16 output gradients were captured without a ``grad_scaler``).
        """
        if not any([w.grad is not None for w in self._weights]):
            # No gradient at all (a training_step that returned None, a loss that did not reach these layers):
            # the optimizer step does nothing, so neither does K-FAC; the step does not count.
            self.discard_statistics()
            return
        try:
            scale = resolve_grad_scale(self, grad_scale)
            if self.is_factor_update_step:
                weights = [h.weight for h in self.handlers]  # re-read: a replaced parameter makes a new plan
                if any([a is not b for a, b in zip(weights, self._weights)]):
                    self._weights = weights
                note_shared_layers(self)
                update_factors(self, scale)  # step 1 of Algorithm 1
            spread = self.options.spread_decompositions
            if self._missing_decompositions() or (self.is_inv_update_step and not spread):
                self._update_decompositions()
            elif spread:  # this step's phase of the interval
                self._update_decompositions(self._spread.due(self.handlers, self.inv_update_freq, self.steps))
            self._precondition(lr)
        finally:
            self.discard_statistics()
            self.steps += 1

    def _missing_decompositions(self) -> bool:
        """Layers with factors but no decomposition on a rank that must hold it (hooks that fired late, a checkpoint
        restored with a gradient-worker fraction below 1): decomposed at once, not at the next interval. Every rank
        answers alike: factors, shared decompositions and a layer's workers' decompositions are identical. Asked
        again only once factors or decompositions were replaced (:func:`~.layers.state.generation`)."""
        if self._complete_at != generation():
            if any(h.factors and not h.decompositions for i, h in enumerate(self.handlers) if self._is_worker(i)):
                return True
            self._complete_at = generation()
        return False

    def comm_device(self) -> torch.device:
        """The device of K-FAC's collectives, the layers' (NCCL needs CUDA tensors, gloo takes CPU ones)."""
        return self.handlers[0].weight.device

    # decompositions and who holds them (:mod:`.worker_groups`) ---------------------------------------------------
    def assignment(self) -> dict[tuple[int, str], int]:
        """``(layer index, factor name) -> rank`` that decomposes each factor (within the layer's worker group)."""
        return worker_groups.layout(self)[1]

    def layer_columns(self) -> list[int]:
        """The gradient-worker group (column of :attr:`grid`) of each layer."""
        return worker_groups.layout(self)[0]

    def _is_worker(self, i: int) -> bool:
        """This rank holds layer ``i``'s decompositions and preconditions its gradient."""
        return self.grid.column_of(self.comm.rank) == self.layer_columns()[i]

    def _update_decompositions(self, due: set[tuple[int, str]] | None = None) -> None:
        """Step 2 of Algorithm 1 for every factor, or for the ``(layer index, factor)`` pairs ``due``."""
        worker_groups.decompose(self, due)

    # preconditioning ------------------------------------------------------------------------------------
    def _precondition_layers(self, handlers: Sequence[LayerHandler],
                             grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The preconditioned gradients of ``handlers`` (with decompositions), by buckets (:mod:`.batched`)."""
        return self._buckets.precondition(handlers, grads, self.method, self.damping, self.decomposition_dtype)

    def _precondition(self, lr: float | None) -> None:
        """Step 3 of Algorithm 1: precondition, scale by the KL clip of Eq 18, write back into ``.grad``; without
        gradient workers' broadcasts, from and into ``.grad`` by the buckets' kept plan (:mod:`.batched`)."""
        kl_clip, b = self.current_kl_clip(), self._buckets
        if self.comm.world_size > 1 and self.grid.broadcasts_gradients:
            self._last_nu = worker_groups.precondition_by_workers(self, lr, kl_clip)
        elif b.precondition_grads(self.handlers, self._weights, self.method, self.damping, self.decomposition_dtype,
                                  kl_terms=bool(kl_clip)):
            # nu stays on the device (no read-back): the scaling is applied whatever its value
            self._last_nu = kl_clip_factor([t for _, t in b.last_kl_terms], self._lrs.squares(
                b.last_kl_layers, lr, self.optimizer, self.lr, b.last_outputs[0].device), kl_clip) if kl_clip else None
            if self._last_nu is not None:
                b.scale_(self._last_nu)
            b.write_back()

    # -- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, running factors and every layer's decompositions, so a resumed run continues bitwise.

        With a gradient-worker fraction below 1 (multi-rank ``layer_wise`` by default) the decompositions are
        sharded across ranks; this method then gathers them and is a collective: call it on every rank
        (Lightning's checkpointing does), before rank 0 writes (:mod:`.checkpoint`)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the same checkpoint on every rank). With a gradient-worker
        fraction below 1 each rank keeps only its worker group's decompositions; decompositions missing from an older
        checkpoint are recomputed from the saved factors at the next step (then not bitwise)."""
        checkpoint.load_state_dict(self, state)


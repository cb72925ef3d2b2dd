"""``KFAC``: the Lightning callback that runs :class:`~lightning_hpc.kfac.preconditioner.KFACPreconditioner`.

It translates Lightning hooks, and refuses before the first step what it cannot precondition exactly:

* ``setup`` (fit): checks the precision (a grad scaler needs
  :class:`~lightning_hpc.kfac.precision.KFACMixedPrecision`) and that the strategy supports K-FAC (a strategy
  whose ``kfac_unsupported`` is a message refuses it), picks the communicator and registers the factor hooks on the
  LightningModule's layers; which layers it preconditions and which it leaves to the optimizer, with the reason,
  is said on rank 0 when fitting starts (after the per-optimizer build that several optimizers need). Strategies
  that change or declare layers in their own ``setup`` (``replaces_layers_in_setup = True``: hybrid_fc's sharded
  head, the spatial strategy's tiled convolutions and norms) run it after the callbacks' ``setup``; the
  preconditioner is then built in ``on_fit_start``, on the layers that run, still before training starts.  The
  layers a strategy runs on spatial tiles come from the strategy (``kfac_tiled_layers``), which hands its registry
  to the preconditioner.
* ``on_fit_start``: remembers the trainable parameters under a strategy that does not follow trainability changes,
  builds a deferred preconditioner and loads a pending checkpoint state.  With several optimizers (a GAN's generator
  and discriminator, stepped in manual optimization) it builds one preconditioner per optimizer, over the layers
  whose parameters that optimizer steps (:attr:`KFAC.preconditioners`): each has its own factors, schedule step
  counter and KL clip (Eq 18, with its optimizer's lr), and steps before its optimizer's step.
* ``on_train_epoch_start``: applies the epoch schedules (damping decay, update-frequency decay).
* ``on_train_batch_start``: tells the preconditioner whether this batch's backward pass is the last of the
  optimizer step (Lightning's own accumulation decision, a short last group included), so that with
  ``overlap_factor_allreduce`` only that backward pass launches the factor all-reduce (the earlier micro-batches
  only accumulate statistics, as ``KFACPreconditioner.no_sync`` does in a plain loop).
* ``on_before_optimizer_step``: Lightning calls it after the strategy reduced the gradients and AMP unscaled
  them, once per optimizer step (after the last accumulated micro-batch): the paper's ``preconditioner.step()``
  slot of Listing 1. The optimizer's current lr feeds the KL clip (Eq 18).  It reads gradients and parameters
  only (``postponed_update_safe``: layered SGD may run it when it applies its postponed update).  Under a
  strategy that does not follow trainability changes (Lightning's DDP), parameters that became trainable or
  frozen since ``on_fit_start`` are refused here, before the step on their unreduced gradients.  A step the
  grad scaler of ``KFACMixedPrecision`` skips (inf / NaN gradients) drops its statistics and does not count.
* ``state_dict`` / ``load_state_dict``: factors, decompositions and counters travel in Lightning checkpoints
  (restored at ``on_fit_start``, or at once under a strategy that restores the checkpoint after its setup).
* ``teardown`` (fit): removes the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpc.distributed.backend import BACKENDS, communicator_for
from lightning_hpc.distributed.comm import Communicator
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.distributed.trainability import REBUILD_FIX, TrainableSet
from lightning_hpc.kfac.compiled import CompiledUnderKFAC, attach_compiled, detach_compiled
from lightning_hpc.kfac.discovery import find_layers, own_parameters
from lightning_hpc.kfac.options import KFACOptions, compile_skip_patterns
from lightning_hpc.kfac.precision import KFACMixedPrecision
from lightning_hpc.kfac.preconditioner import KFACPreconditioner
from lightning_hpc.protocols import contract_of

__all__ = ["KFAC"]


class KFAC(Callback):
    """K-FAC gradient preconditioning for any optimizer (SC20).

    Every option is a typed keyword argument (the fields of :class:`~lightning_hpc.kfac.options.KFACOptions`,
    which documents and validates them; a test keeps the two in step), so LightningCLI
    (``--trainer.callbacks+=lightning_hpc.KFAC --trainer.callbacks.damping=0.01``), jsonargparse, Hydra's
    ``_target_`` (``conf/callbacks/kfac.yaml``) and IDEs see them; :meth:`from_options` takes a ready
    ``KFACOptions``. ``communicator`` may also be a backend name: ``"auto"`` (default: the strategy's backend,
    Horovod under ``strategy="horovod"``, else torch.distributed), ``"torch"``, ``"horovod"``. Invalid options raise
    at construction, a precision without the K-FAC plugin or a strategy that refuses K-FAC at setup: all before
    training starts. Several optimizers (manual optimization) get one preconditioner each (:attr:`preconditioners`)."""

    #: its step hook reads gradients and parameters only (see :class:`lightning_hpc.protocols.PostponedUpdateSafe`)
    postponed_update_safe = True

    def __init__(
        self,
        *,
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
        spread_decompositions: bool = False,
        communicator: str | Communicator = "auto",
    ) -> None:
        self.options = KFACOptions.from_arguments(locals())  # the fields among this call's arguments
        if isinstance(communicator, str) and communicator not in BACKENDS:
            raise ValueError(f"KFAC communicator must be one of {BACKENDS} or a Communicator, got {communicator!r}")
        self.communicator = communicator
        destroy_process_group_at_exit()  # the factor collectives are asynchronous
        #: the preconditioner of each optimizer, by its index in ``trainer.optimizers`` (an optimizer none of whose
        #: layers K-FAC preconditions has none); one optimizer: ``{0: preconditioner}``
        self.preconditioners: dict[int, KFACPreconditioner] = {}
        #: the preconditioners were built per optimizer (several optimizers), not over every layer of the module
        self._per_optimizer = False
        self._pending_state: dict[str, Any] | None = None
        self._deferred = False
        #: the compiled modules whose forward K-FAC's route took while fitting (:mod:`lightning_hpc.kfac.compiled`)
        self._compiled: list[CompiledUnderKFAC] = []
        #: on_fit_start has run in this fit: the model is on its device, so restored state can be placed at once
        self._fit_started = False
        #: the parameters trainable when training started, under a strategy that cannot follow a change
        self._trainable: TrainableSet | None = None
        #: the setup report of the last build, said at fit start: (text, whether it warns)
        self._report: tuple[str, bool] | None = None
        #: ids of the parameters trainable at setup, for a build deferred to on_fit_start
        self._trainable_at_setup: set[int] = set()

    @property
    def preconditioner(self) -> KFACPreconditioner | None:
        """The preconditioner of the only optimizer (None until it is built); with several optimizers, each one's is
        in :attr:`preconditioners`."""
        if self._per_optimizer:
            raise RuntimeError("KFAC preconditions the layers of several optimizers: KFAC.preconditioners holds each "
                               "optimizer's preconditioner, by its index in trainer.optimizers")
        return self.preconditioners.get(0)

    @classmethod
    def from_options(cls, options: KFACOptions, communicator: str | Communicator = "auto") -> KFAC:
        """The callback for a ready :class:`~lightning_hpc.kfac.options.KFACOptions`."""
        return cls(**options.as_kwargs(), communicator=communicator)

    # -- setup -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._fit_started = False
        if self.preconditioners:
            return
        self.check_precision(trainer)
        contract = contract_of(trainer.strategy)
        if contract.kfac_unsupported:  # before any layer is hooked or any step runs
            raise ValueError(contract.kfac_unsupported)
        # which layers are preconditioned is decided by what trains now, also when built later (below): a callback
        # whose setup comes later and freezes a backbone until it unfreezes it (BackboneFinetuning) must not drop it
        self._trainable_at_setup = {id(p) for p in pl_module.parameters() if p.requires_grad}
        if contract.replaces_layers_in_setup:
            self._deferred = True  # hook the layers the strategy's setup puts in place (on_fit_start)
            return
        self._build(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after every setup hook (BackboneFinetuning freezes in its setup) and the strategy's gradient reduction
        follows = contract_of(trainer.strategy).follows_trainability_changes
        self._trainable = None if follows or trainer.world_size == 1 else TrainableSet(pl_module)
        several = len(trainer.optimizers) > 1
        if several and self.preconditioners and not self._per_optimizer:
            # built in setup over every layer, before the optimizers existed: one per optimizer instead
            self.preconditioners[0].remove_hooks()
            self.preconditioners = {}
            self._deferred = True
        if self._deferred and not self.preconditioners:
            self._deferred = False
            # trainable when setup ran, frozen since (by a later callback's setup): discovered as trainable, as a
            # build in setup would have found them (the strategy's replacement layers are new: as they are)
            frozen_since = [p for p in pl_module.parameters() if id(p) in self._trainable_at_setup
                            and not p.requires_grad]
            for p in frozen_since:
                p.requires_grad_(True)
            try:
                self._build(trainer, pl_module, trainer.optimizers if several else None)
            finally:
                for p in frozen_since:
                    p.requires_grad_(False)
        if self._report is not None:
            report, warn = self._report
            self._report = None
            (rank_zero_warn if warn else rank_zero_info)(report)
        if self.preconditioners and self._pending_state is not None:
            self._load(self._pending_state)
            self._pending_state = None
        if self.preconditioners:
            # after the strategy's setup, which may have given a compiled module its own forward (spatial)
            self._compiled = attach_compiled(list(self.preconditioners.values()), pl_module)
        self._fit_started = True

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
               optimizers: Sequence[torch.optim.Optimizer] | None = None) -> None:
        """The preconditioner of every layer, or with ``optimizers`` (several), one per optimizer over the layers
        whose parameters it steps."""
        contract = contract_of(trainer.strategy)
        note = contract.kfac_note
        if note:  # layers the strategy replaced by ones K-FAC does not precondition: say so, once
            rank_zero_warn(note)
        comm = communicator_for(trainer.strategy, self.communicator)

        def build(parameters: list[torch.Tensor] | None) -> KFACPreconditioner:
            # the layers this run's strategy tiles (spatial parallelism), from the strategy itself
            return KFACPreconditioner.from_options(pl_module, self.options, communicator=comm, announce=False,
                                                   tiled_layers=contract.kfac_tiled_layers, parameters=parameters)

        self._per_optimizer = optimizers is not None
        shared: list[str] = []
        if optimizers is None:
            self.preconditioners = {0: build(None)}
            report = self.preconditioners[0].describe_layers()
        else:
            held = [[p for group in opt.param_groups for p in group["params"]] for opt in optimizers]
            held_ids = [{id(p) for p in params} for params in held]
            # a layer whose parameters several optimizers step (one parameter in two, or its weight in one and its
            # bias in another): left to them, named once below, and none of its parameters offered to any of them
            split = [(name or "<root>", own) for name, m in pl_module.named_modules() if (own := own_parameters(m))
                     and sum(any(id(p) in ids for p in own) for ids in held_ids) > 1]
            split_ids = {id(p) for _, own in split for p in own}
            owned = [[p for p in params if id(p) not in split_ids] for params in held]
            patterns = compile_skip_patterns(self.options.skip_layers)
            with_layers = [i for i, params in enumerate(owned) if find_layers(
                pl_module, patterns, self.options.layer_types, contract.kfac_tiled_layers, {id(p) for p in params}
            ).handlers]
            if not with_layers:
                build(None)  # raises: no layer to precondition
            # every rank builds the same preconditioners in the same order (their process groups are collective)
            self.preconditioners = {i: build(owned[i]) for i in with_layers}
            lines = [f"optimizer {i} ({type(opt).__name__}): "
                     + (self.preconditioners[i].describe_layers() if i in self.preconditioners
                        else "K-FAC preconditions none of its layers") for i, opt in enumerate(optimizers)]
            shared = [name for name, _ in split]
            if shared:
                lines.append(f"left to the optimizers, whose parameters several optimizers step: {', '.join(shared)}")
            report = "\n".join(lines)
        #: said once, on rank 0, when fitting starts (a build in setup is replaced there when there are several
        #: optimizers): what is preconditioned, what is left to the optimizer and why, and whether to warn
        self._report = (report, bool(shared) or any(pre.skipped_modules for pre in self.preconditioners.values()))

    def preconditioner_of(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> KFACPreconditioner | None:
        """The preconditioner that steps before ``optimizer`` (None: K-FAC preconditions none of its layers)."""
        if not self._per_optimizer:
            return self.preconditioners.get(0)
        raw = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's wrapped optimizer
        for i, opt in enumerate(trainer.optimizers):
            if opt is raw or opt is optimizer:
                return self.preconditioners.get(i)
        return None

    @staticmethod
    def check_precision(trainer: pl.Trainer) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(plugin, KFACMixedPrecision):
            raise ValueError(
                f"KFAC with precision={trainer.precision!r} needs the K-FAC mixed-precision plugin, so factor "
                "statistics are unscaled and steps the grad scaler skips are dropped: use "
                "Trainer(plugins=[lightning_hpc.KFACMixedPrecision('16-mixed', device=...)]) without precision=, "
                "or precision=kfac_16-mixed in a lightning-hpc recipe"
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.preconditioners:
            detach_compiled(self._compiled)
            self._compiled = []
            for pre in self.preconditioners.values():
                pre.remove_hooks()

    # -- training ----------------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for pre in self.preconditioners.values():
            pre.set_epoch(trainer.current_epoch)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        final = self.last_micro_batch(trainer, batch_idx)
        for pre in self.preconditioners.values():
            pre.final_micro_batch = final

    @staticmethod
    def last_micro_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
        """Whether the optimizer steps after this batch: Lightning's own decision (the fit loop's
        ``_should_accumulate``, which also steps on an epoch's short last group), else every
        ``accumulate_grad_batches``-th batch. A wrong answer costs overlap, never correctness: a backward pass
        not marked last leaves the all-reduce to the step, and statistics arriving after a launch make the
        step reduce again synchronously."""
        should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        if callable(should_accumulate):
            return not should_accumulate()
        return (batch_idx + 1) % trainer.accumulate_grad_batches == 0

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        pre = self.preconditioner_of(trainer, optimizer)
        if pre is None:
            return
        if self._trainable is not None:  # the strategy reduced the gradients of the parameters trainable at start
            self._trainable.refuse_changes(pl_module, "KFAC", REBUILD_FIX)
        plugin = trainer.precision_plugin
        grad_scale = 1.0
        if isinstance(plugin, KFACMixedPrecision):
            if plugin.kfac_found_inf:
                # The scaler skips this step: its statistics never enter the running averages, and the step
                # does not count (the next one is again a factor-update step).
                pre.discard_statistics()
                return
            grad_scale = plugin.kfac_grad_scale
        pre.optimizer = optimizer
        pre.step(grad_scale=grad_scale)

    # -- checkpointing -----------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.preconditioners:
            return dict(self._pending_state or {})
        if self._per_optimizer:
            return {"per_optimizer": {i: pre.state_dict() for i, pre in self.preconditioners.items()}}
        return self.preconditioners[0].state_dict()

    def _load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into preconditioners built alike (one, or one per optimizer)."""
        per = state.get("per_optimizer")
        if self._per_optimizer != (per is not None) or (per is not None and set(per) != set(self.preconditioners)):
            def which(per_optimizer: bool, indices: Any) -> str:
                return f"the optimizers {sorted(indices)}" if per_optimizer else "one optimizer"

            raise ValueError(
                f"the checkpoint's K-FAC state preconditions the layers of {which(per is not None, per or ())}, this "
                f"fit those of {which(self._per_optimizer, self.preconditioners)}: resume with the "
                "configure_optimizers the checkpoint was trained with")
        if per is None:
            self.preconditioners[0].load_state_dict(state)
        else:
            for i, pre in self.preconditioners.items():
                pre.load_state_dict(per[i])

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.preconditioners and self._fit_started:
            # a strategy that restores the checkpoint after its setup (restore_checkpoint_after_setup: hybrid_fc
            # restores into its sharded model), which Lightning does after on_fit_start: the layers are hooked and
            # on their device already
            self._load(state_dict)
            return
        # Lightning restores callbacks before the strategy moves the model to its device (the preconditioner may be
        # built already, in setup): the factors are placed on the layers' device at fit start (on_fit_start), once
        # the parameters are where they train
        self._pending_state = state_dict

"""Lightning adapter of layered SGD (Yu et al., Algorithm 3): ``Trainer(strategy="layered_sgd")``.

The algorithm lives in plain torch (:mod:`lightning_hpc.layered_sgd.hierarchical`,
:mod:`lightning_hpc.layered_sgd.postponed_update`); this module only decides *when* Lightning's flow calls it.

How one optimizer step is split (automatic optimization):

- ``optimizer_step`` of step ``t`` runs Lightning's closure (forward, zero_grad, backward); during that backward
  pass gradient hooks start the hierarchical reduction bucket by bucket as the buckets fill (Algorithm 3 lines 6
  and 8, overlapped with the rest of the backward pass, like DDP's bucketed allreduce); afterwards the
  remaining buckets are started.  It returns without touching the weights.  Backward passes outside
  ``optimizer_step`` (the first micro-batches of ``accumulate_grad_batches``) start no reduction: only the
  accumulated gradient is reduced, as with DDP's ``no_sync``.
- Manual optimization: as under DDP, gradients are global when ``manual_backward`` returns (each backward pass
  averages the accumulated gradient over the ranks), so ``self.clip_gradients`` and any read of ``.grad``
  before ``opt.step()`` see the global gradient; ``opt.step()`` then updates at once (nothing is postponed).
- Before anything of step ``t+1`` reads the weights -- i.e. after batch ``t+1`` has been loaded and moved to the
  device, before the first ``on_train_batch_start`` callback and the forward pass -- the reduction is completed
  (line 9) and the *whole* remainder of Lightning's optimizer step is replayed through the precision plugin:
  ``on_before_optimizer_step`` callbacks and hook, gradient clipping, AMP unscaling / inf checks, the optimizer
  step and the scaler update (line 10).  So every gradient reader sees the globally averaged gradient, with
  the optimizer hyper-parameters and ``trainer.global_step`` step ``t`` had.
- Code that observes the step sees what one process sees: when the LightningModule overrides ``optimizer_step``
  (code after ``optimizer.step()`` expects the new weights), ``on_before_optimizer_step`` (a value it logs
  belongs to this step's log line) or ``on_train_batch_end`` (it may read the new weights), or a callback runs code
  of its own in ``on_before_optimizer_step`` / ``on_train_batch_end`` (an EMA, a weight projection, a logged
  gradient norm), the run updates at once, inside ``optimizer_step`` as DDP does (the reduction still overlaps
  the backward pass), and says so once.  Callbacks are judged by the class that implements each hook, not by
  ``isinstance``: Lightning's progress bars, ``ModelCheckpoint``, ``Timer`` and monitors are trusted for their own
  implementations only (a ``ModelCheckpoint`` subclass overriding ``on_train_batch_end`` is an observer), and a
  ``postponed_update_safe = True`` declaration (the K-FAC callback) covers the hooks of the declaring class and
  its bases, not a subclass's overrides.
- ``on_after_backward`` runs inside the backward pass, where DDP shows the gradient averaged over the ranks.  When
  the module or a callback implements it, the backward pass inside ``optimizer_step`` completes the reduction
  before that hook runs (it sees the average; accumulation micro-batches show the rank's own gradient, as with
  DDP's ``no_sync``), the update is applied at once, and the run says so once.
- A parameter whose ``requires_grad`` changes (``BackboneFinetuning`` unfreezing the backbone, a callback freezing
  a layer) is reduced from that step on: the buckets are rebuilt for the trainable parameters before the step's
  backward pass.
- Pending updates are flushed before validation/test, checkpointing (``lightning_module_state_dict``), the end
  of every training epoch and the end of training, so nothing observes stale weights and no step is lost.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    ModelCheckpoint,
    ProgressBar,
    RichProgressBar,
    SpikeDetection,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_hpc._compat import automatic_optimizer_step_progress
from lightning_hpc.distributed.backend import communicator_for
from lightning_hpc.distributed.comm import Communicator, TorchDistributedCommunicator
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.distributed.failure import RunFailures
from lightning_hpc.distributed.groups import (
    check_divisible,
    gather_hostnames,
    hosts_layout,
    local_world_size_from_env,
)
from lightning_hpc.distributed.sigterm import sigterm_without_collective
from lightning_hpc.distributed.start_equal import module_state_tensors, start_equal
from lightning_hpc.distributed.trainability import TrainableSet
from lightning_hpc.layered_sgd.hierarchical import (
    HierarchicalAllreduce,
    LayeredGroups,
    build_layered_groups,
)
from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate
from lightning_hpc.protocols import PostponedUpdateSafe, StrategyContract
from lightning_hpc.registry import launcher_environment

__all__ = ["LayeredSGDStrategy"]


class _FlushBeforeReaders(Callback):
    """Internal callback put *first* in ``trainer.callbacks`` so the postponed update lands before any other
    callback's hook of the same name can look at the weights."""

    def __init__(self, strategy: LayeredSGDStrategy) -> None:
        self._strategy = strategy

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._strategy.flush()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.flush()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.flush()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.flush()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.flush()


#: Lightning's callbacks whose own step hooks read no parameter (ModelCheckpoint's save reads them through
#: ``lightning_module_state_dict``, which applies the pending update first).  Only their *own* implementations are
#: trusted: a subclass that overrides one of the hooks runs code of its own there and is an observer.
_NOT_OBSERVING: tuple[type[Callback], ...] = (
    Callback, ProgressBar, TQDMProgressBar, RichProgressBar, ModelCheckpoint, Timer, DeviceStatsMonitor,
    ThroughputMonitor, SpikeDetection,
)
#: hooks of the LightningModule / of callbacks that run between the optimizer step and the next batch's start
_MODULE_STEP_HOOKS = ("optimizer_step", "on_before_optimizer_step", "on_train_batch_end")
_CALLBACK_STEP_HOOKS = ("on_before_optimizer_step", "on_train_batch_end")
#: the hook that runs inside the backward pass, where DDP shows the averaged gradient
_BACKWARD_HOOK = "on_after_backward"


def _defining_class(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body defines the attribute ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def _trusted_up_to(cb: Callback) -> type | None:
    """The class that declared ``postponed_update_safe = True`` for ``cb`` (the instance's own class when the
    instance set it); ``None`` when nothing declared it.  The declaration covers the hooks as that class (and its
    bases) implement them, not overrides a subclass added after it."""
    if "postponed_update_safe" in getattr(cb, "__dict__", {}):
        return type(cb) if cb.__dict__["postponed_update_safe"] is True else None
    if not isinstance(cb, PostponedUpdateSafe):
        return None
    declaring = _defining_class(type(cb), "postponed_update_safe")
    return declaring if vars(declaring)["postponed_update_safe"] is True else None


def _user_hooks(cb: Callback, hooks: tuple[str, ...], honour_safe: bool) -> list[str]:
    """The hooks of ``hooks`` that ``cb`` runs user code in: implementations that are neither ``Callback``'s
    no-op nor one of Lightning's non-observing callbacks' own, nor (``honour_safe``) covered by a
    ``postponed_update_safe`` declaration.  Decided by which class defines each hook, not by ``isinstance``."""
    cls, safe = type(cb), _trusted_up_to(cb) if honour_safe else None
    found = []
    for hook in hooks:
        impl = getattr(cls, hook)
        if any(impl is getattr(known, hook) for known in _NOT_OBSERVING if issubclass(cls, known)):
            continue
        if safe is not None and issubclass(safe, _defining_class(cls, hook)):
            continue
        found.append(hook)
    return found


def step_observers(module: pl.LightningModule, callbacks: list[Callback]) -> list[str]:
    """The user code that would see the postponed update (``Class.hook``): step hooks overridden by the module,
    and step hooks callbacks implement with code of their own (see :func:`_user_hooks`)."""
    found = [f"{type(module).__name__}.{h}" for h in _MODULE_STEP_HOOKS
             if getattr(type(module), h) is not getattr(pl.LightningModule, h)]
    for cb in callbacks:
        if not isinstance(cb, _FlushBeforeReaders):
            found += [f"{type(cb).__name__}.{h}" for h in _user_hooks(cb, _CALLBACK_STEP_HOOKS, honour_safe=True)]
    return found


def backward_observers(module: pl.LightningModule, callbacks: list[Callback]) -> list[str]:
    """The user code in ``on_after_backward`` (``Class.on_after_backward``), module or callbacks.  It runs inside
    the backward pass, before the postponed reduction would complete; DDP shows it the averaged gradient, so a
    run with any of it completes the reduction first.  A ``postponed_update_safe`` declaration does not cover it:
    the hook reads gradients at a point the postponement moves, not after it."""
    found = [f"{type(module).__name__}.{_BACKWARD_HOOK}"] if (
        type(module).on_after_backward is not pl.LightningModule.on_after_backward) else []
    for cb in callbacks:
        if not isinstance(cb, _FlushBeforeReaders):
            found += [f"{type(cb).__name__}.{h}" for h in _user_hooks(cb, (_BACKWARD_HOOK,), honour_safe=False)]
    return found


class LayeredSGDStrategy(StrategyContract, DDPStrategy):
    """Layered SGD: hierarchical gradient reduction overlapped with data loading, identical to synchronous SGD.

    Args:
        procs_per_node: ranks per group ("node"; the paper's subgroup with one communicator).  Defaults to the
            launcher's local world size (torchrun ``LOCAL_WORLD_SIZE``, SLURM tasks per node, ...) or, failing
            that, the number of devices per node Lightning was given.  Set it to simulate several nodes on one
            machine, e.g. ``procs_per_node=2`` with ``devices=4``.
        communicator: ``"auto"`` (default: Horovod process sets when launched by ``horovodrun``, else
            torch.distributed), ``"torch"``, ``"horovod"``, or a
            :class:`~lightning_hpc.distributed.comm.Communicator` instance.  Under ``horovodrun`` the strategy
            takes its ranks from Horovod (:class:`~lightning_hpc.horovod.environment.HorovodEnvironment`)
            unless a ``cluster_environment`` is given.
        layered_timeout_s: a layered collective that does not finish in this time raises an error naming the
            group and rank (defaults to the process-group ``timeout``).
        broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 before every forward
            pass, as ``DistributedDataParallel(broadcast_buffers=True)`` does.
        bucket_cap_mb: size of the gradient buckets whose reduction starts during the backward pass (the first
            bucket, holding the last layers' gradients, is 1 MB so communication starts early), as DDP's.
        overlap_backward: start bucket reductions from gradient hooks during the backward pass (default); with
            ``False`` the whole reduction starts after the backward pass.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``cluster_environment``, ...).  DDP-wrapper options do not apply: no DDP wrapper is used.
    """

    strategy_name = "layered_sgd"
    follows_trainability_changes = True

    def __init__(
        self,
        procs_per_node: int | None = None,
        communicator: str | Communicator = "auto",
        layered_timeout_s: float | None = None,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25.0,
        overlap_backward: bool = True,
        **kwargs: Any,
    ) -> None:
        if procs_per_node is not None and (not isinstance(procs_per_node, int) or procs_per_node < 1):
            raise ValueError(f"procs_per_node={procs_per_node!r}: must be a positive integer (ranks per node group)")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: must be > 0 (megabytes per gradient bucket)")
        if kwargs.get("cluster_environment") is None and (launched := launcher_environment()) is not None:
            kwargs["cluster_environment"] = launched
        destroy_process_group_at_exit()  # gloo's async work must not outlive the interpreter
        super().__init__(**kwargs)
        self._failures = RunFailures("layered_sgd")
        self.procs_per_node_setting = procs_per_node
        self._communicator_setting = communicator
        self._layered_timeout_s = layered_timeout_s
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.overlap_backward = bool(overlap_backward)
        #: True only while Lightning's closure runs inside optimizer_step: the backward pass that may start
        #: bucket reductions (every other backward pass accumulates locally)
        self._reduce_in_backward = False
        self._failed = False
        self.groups: LayeredGroups | None = None
        self.allreduce: HierarchicalAllreduce | None = None
        self.update: PostponedUpdate | None = None
        self._pending: dict[str, Any] | None = None
        self._flush_callback: _FlushBeforeReaders | None = None
        self.comm: Communicator | None = None
        #: the user code that observes the step (empty: the update is postponed); set at setup for fit
        self.observers: list[str] = []
        #: the user code in ``on_after_backward`` (non-empty: the reduction completes before that hook runs and
        #: the update is applied at once); set at setup for fit
        self.backward_observers: list[str] = []
        #: True once the backward pass inside optimizer_step has made the gradients global (backward observers)
        self._reduced_in_backward = False
        self._trainable: TrainableSet | None = None

    # ------------------------------------------------------------------ topology
    def resolve_procs_per_node(self) -> int:
        """Group size: the explicit setting, else the launcher's local world size, else devices per node."""
        if self.procs_per_node_setting is not None:
            return self.procs_per_node_setting
        from_env = local_world_size_from_env()
        if from_env:
            return from_env
        return max(1, len(self.parallel_devices or []) or self.world_size // max(1, self.num_nodes))

    def node_layout(self) -> list[list[int]] | None:
        """The ranks of each host, when the ranks run on several hosts and ``procs_per_node`` is not set.

        Launchers may place ranks on nodes in any order (``srun --distribution=cyclic`` puts rank 1 on the
        second node), so node groups follow the hostnames the ranks report, not rank blocks.  ``None`` (contiguous
        blocks of ``procs_per_node``) with an explicit ``procs_per_node`` (nodes simulated on one machine), with
        all ranks on one host, or with a communicator other than torch.distributed.  Collective.
        """
        if self.procs_per_node_setting is not None or not isinstance(self.comm, TorchDistributedCommunicator):
            return None
        layout = hosts_layout(gather_hostnames())
        return layout if len(layout) > 1 else None

    def check_topology(self) -> int:
        """Raise before training when the group size does not divide the world size (names both numbers)."""
        group = self.resolve_procs_per_node()
        check_divisible(self.world_size, group, what="ranks per node group of layered SGD", setting="procs_per_node")
        return group

    @property
    def timeout_seconds(self) -> float | None:
        if self._layered_timeout_s:
            return float(self._layered_timeout_s)
        return self._timeout.total_seconds() if isinstance(self._timeout, datetime.timedelta) else None

    # ------------------------------------------------------------------ setup
    @override
    def _configure_launcher(self) -> None:
        # Called from Trainer(...) once devices and num_nodes are known: reject a bad topology before any
        # process is launched or any batch is loaded.
        if self.parallel_devices is not None:
            world = self.num_nodes * len(self.parallel_devices)
            check_divisible(world, self.resolve_procs_per_node(), what="ranks per node group of layered SGD",
                            setting="procs_per_node")
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # launches / joins the process group
        self.check_topology()

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: build the two communication layers instead."""
        group_size = self.check_topology()
        comm = self._communicator_setting
        self.comm = communicator_for(self, comm)
        intra_backend = self._get_process_group_backend()
        layout = self.node_layout()
        self.groups = build_layered_groups(
            group_size, self.comm, intra_backend=intra_backend, timeout_s=self.timeout_seconds, layout=layout
        )
        if self.global_rank == 0:
            groups = layout or [list(range(g, g + group_size)) for g in range(0, self.world_size, group_size)]
            print(f"layered SGD node groups: {groups}", flush=True)
        self.allreduce = HierarchicalAllreduce(self.groups, self.comm, timeout_s=self.timeout_seconds)
        if isinstance(self.comm, TorchDistributedCommunicator) and torch.distributed.is_initialized():
            # data parallel over every rank: a 1-D mesh over the world group (no new group is made)
            from torch.distributed.device_mesh import DeviceMesh

            world = torch.distributed.group.WORLD
            assert world is not None  # initialised
            self._device_mesh = DeviceMesh.from_group(world, self.root_device.type, mesh_dim_names=("data",))
        else:
            self._no_device_mesh = "the ranks communicate through Horovod, not torch.distributed"
        assert self.lightning_module is not None
        self._build_buckets()
        self._sync_from_rank0(with_parameters=True)

    def _build_buckets(self) -> None:
        """Buckets (and gradient hooks) for the parameters trainable now."""
        module = self.lightning_module
        assert module is not None and self.allreduce is not None
        if self.update is not None:
            self.update.close()  # a previous fit's (or trainability's) hooks
        self.update = PostponedUpdate(
            module.parameters(), self.allreduce, bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=min(1.0, self.bucket_cap_mb), overlap_backward=self.overlap_backward,
        )
        self._trainable = TrainableSet(module)

    def _follow_trainability(self) -> None:
        """Rebuild the buckets when parameters became trainable or frozen since they were built (no update may be
        pending: called after :meth:`flush`, before the step's backward pass).  Every rank changes
        ``requires_grad`` at the same step (callbacks run alike), so every rank rebuilds the same buckets."""
        module = self.lightning_module
        if self._trainable is None or module is None or not self._trainable.changed(module):
            return
        gained, lost = self._trainable.changes(module)
        self._build_buckets()
        rank_zero_info(
            f"layered SGD: trainable parameters changed at step {self._step_progress().total.completed} "
            f"(became trainable: {gained[:5]}, frozen: {lost[:5]}); gradients are reduced for the new set from this "
            "step on"
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        sigterm_without_collective(trainer)  # SIGTERM ends every rank promptly (no collective in its handler)
        self._failures.start()  # a failing rank's message reaches every peer promptly
        super().setup(trainer)
        for opt in self.optimizers:
            if isinstance(opt, LBFGS):
                raise ValueError(
                    "strategy='layered_sgd' postpones the optimizer step and cannot re-evaluate the closure that "
                    "LBFGS needs; use an optimizer that takes one step per closure (SGD, Adam, ...)"
                )
        # The scheduler of step t steps before the postponed optimizer step of step t (the update still uses
        # step t's lr, see PostponedUpdate), which makes torch warn about the order on the first step.
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
        )
        if trainer.state.fn == "fit" and self._flush_callback is None:
            self._flush_callback = _FlushBeforeReaders(self)
            # set by Lightning, undeclared on Trainer
            trainer.callbacks.insert(0, self._flush_callback)  # type: ignore[attr-defined]
        if trainer.state.fn == "fit" and self.lightning_module is not None:
            # set by Lightning, undeclared on Trainer
            self.observers = step_observers(self.lightning_module, trainer.callbacks)  # type: ignore[attr-defined]
            # set by Lightning, undeclared on Trainer
            self.backward_observers = backward_observers(
                self.lightning_module, trainer.callbacks  # type: ignore[attr-defined]
            )
            if self.backward_observers:
                rank_zero_warn(
                    f"strategy='layered_sgd': {', '.join(self.backward_observers)} reads gradients inside the "
                    "backward pass, where DDP shows the average over the ranks; this run completes the reduction "
                    "before on_after_backward, so it sees that average (the rank's own gradient on accumulation "
                    "micro-batches, as with DDP's no_sync), and updates the weights at once (no postponed update). "
                    "The reduction still overlaps the backward pass. Read gradients in on_before_optimizer_step "
                    "to keep the postponed update"
                )
            if self.observers:
                rank_zero_warn(
                    f"strategy='layered_sgd' updates the weights at once in this run (no postponed update): "
                    f"{', '.join(self.observers)} would otherwise run before the update is applied or log one step "
                    "late. The reduction still overlaps the backward pass. A callback whose step hooks only read "
                    "gradients and parameters may declare postponed_update_safe = True to keep the postponed update"
                )

    def _sync_from_rank0(self, with_parameters: bool) -> None:
        """Start from rank 0's parameters/buffers, as DistributedDataParallel does at construction."""
        assert self.comm is not None and self.lightning_module is not None
        if self.comm.world_size == 1:
            return
        start_equal(module_state_tensors(self.lightning_module, parameters=with_parameters), comm=self.comm)

    # ------------------------------------------------------------------ the postponed step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run forward/backward now, start the reduction, and postpone the update (Algorithm 3, line 10)."""
        self.flush()
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule) and self.update is not None
        if not model.automatic_optimization:
            # Manual optimization: every backward pass already made its gradients global (see backward), so
            # the user's code between manual_backward and step() -- clip_gradients, reading .grad -- sees what
            # DDP would show; the step itself runs at once.
            closure_result = closure()
            return self.precision_plugin.optimizer_step(
                optimizer, model=model, closure=lambda: closure_result, **kwargs
            )
        self._follow_trainability()
        assert self.update is not None
        self._reduce_in_backward, self._reduced_in_backward = True, False
        try:
            closure_result = closure()
        finally:
            self._reduce_in_backward = False
        if self._reduced_in_backward:
            # on_after_backward saw the global gradient (see backward): the step runs now, with this step's settings
            self._reduced_in_backward = False
            return self.precision_plugin.optimizer_step(
                optimizer, model=model, closure=lambda: closure_result, **kwargs
            )
        self.update.begin([optimizer])
        self._pending = {
            "optimizer": optimizer,
            "model": model,
            "closure_result": closure_result,
            "kwargs": kwargs,
            "global_step": self._step_progress().total.completed,
        }
        if self.observers:  # user code observes the step: apply it now, where one process would
            self.flush()
        return closure_result

    def flush(self) -> bool:
        """Complete a pending reduction and apply the postponed update; True if there was one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        assert self.update is not None
        optimizer, model = pending["optimizer"], pending["model"]
        closure_result = pending["closure_result"]
        progress = self._step_progress().total
        # Hooks run during the replayed step see the global step of step t, as in Lightning's own flow.
        ahead = progress.completed - pending["global_step"]
        progress.completed -= ahead
        try:
            self.update.apply(
                lambda: self.precision_plugin.optimizer_step(
                    optimizer, model=model, closure=lambda: closure_result, **pending["kwargs"]
                )
            )
        finally:
            progress.completed += ahead
        return True

    def _step_progress(self) -> Any:
        assert self.lightning_module is not None
        return automatic_optimizer_step_progress(self.lightning_module.trainer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.flush()  # no-op when the callback already flushed; guards custom loops
        assert self.lightning_module is not None
        if self.broadcast_buffers and self.comm is not None and any(True for _ in self.lightning_module.buffers()):
            self._sync_from_rank0(with_parameters=False)
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The backward pass inside :meth:`optimizer_step` starts bucket reductions from gradient hooks; any
        other (accumulation micro-batches) only accumulates local gradients.  Under manual optimization, and in
        a run whose ``on_after_backward`` is user code, the backward pass that reduces completes the reduction
        before ``on_after_backward``, so that hook sees the global gradient, as under DDP (whose reducer
        finishes inside the backward pass)."""
        if self.update is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        if self._reduce_in_backward:
            if not self.backward_observers:
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            self._reduced_in_backward = True
            return self._backward_then_reduce(closure_loss, optimizer, *args, **kwargs)
        if not module.automatic_optimization:
            self._follow_trainability()  # nothing is pending under manual optimization
            # As DDP does: gradients are global when manual_backward returns.  Averaging the accumulated
            # gradient after each backward pass is exact: mean_r(avg(g_1) + g_2^r) = avg(g_1) + avg(g_2).
            with self.update.no_sync():
                return self._backward_then_reduce(closure_loss, optimizer, *args, **kwargs)
        with self.update.no_sync():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _backward_then_reduce(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Lightning's ``Strategy.backward`` with the reduction completed between the backward pass and the
        precision plugin's ``post_backward`` (which runs the ``on_after_backward`` hooks)."""
        module, update = self.lightning_module, self.update
        assert module is not None and update is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        update.begin()  # the buckets the gradient hooks have not started yet
        update.finish_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Nothing to prepare: there is no DDP reducer."""

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing to do: the buckets start from gradient hooks and :meth:`optimizer_step`."""

    # ------------------------------------------------------------------ flush points
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.flush()  # the first thing a checkpoint dump reads, before callbacks' and optimizers' states
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self.flush()
        return super().optimizer_state(optimizer)

    @override
    def on_validation_start(self) -> None:
        self.flush()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.flush()
        super().on_test_start()

    @override
    def on_train_end(self) -> None:
        self.flush()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._pending = None
        self._failed = True
        if self.update is not None:
            self.update.abandon()
        if self.allreduce is not None:
            self.allreduce.close()
        super().on_exception(exception)
        self._failures.share(exception)

    def _teardown_barrier(self) -> None:
        """Every rank waits here until all have finished their collectives.  Under Horovod a rank that exits
        shuts Horovod down on every rank, so a node group that finished first would otherwise kill the step-3
        broadcast still in flight in another group; with torch.distributed it keeps a leader's process (and
        its sockets) alive until its group has received the last broadcast.  Skipped after an exception (the
        other ranks may never arrive)."""
        if self._failed or self.comm is None or self.comm.world_size <= 1:
            return
        if isinstance(self.comm, TorchDistributedCommunicator):
            self.barrier("layered_sgd_teardown")  # NCCL-aware (device_ids)
        else:
            self.comm.barrier()

    @override
    def teardown(self) -> None:
        self._teardown_barrier()
        if self.update is not None:
            self.update.close()  # remove the gradient hooks: the module may be used without this strategy
        if self.allreduce is not None:
            self.allreduce.close()
        if self._flush_callback is not None and self.lightning_module is not None:
            trainer = self.lightning_module._trainer
            # set by Lightning, undeclared on Trainer
            if trainer is not None and self._flush_callback in trainer.callbacks:  # type: ignore[attr-defined]
                # set by Lightning, undeclared on Trainer
                trainer.callbacks.remove(self._flush_callback)  # type: ignore[attr-defined]
        self._flush_callback = None
        self._failures.stop()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registered by :mod:`lightning_hpc.registry` (not under DDP's names)."""

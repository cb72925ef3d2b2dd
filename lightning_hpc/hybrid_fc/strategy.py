"""Lightning adapter of the hybrid data/model-parallel strategy (Krizhevsky, "One weird trick", section 4).

``Trainer(strategy="hybrid_fc")`` or ``HybridParallelStrategy(head="classifier", scheme="c", fc_update=...)``:
the convolutional trunk is data-parallel (DistributedDataParallel averages its gradients, section 4.1), the
fully-connected head is sharded over all ranks by :mod:`lightning_hpc.hybrid_fc` (the head's parameters are
excluded from DDP, so each rank keeps and updates only its 1/K, and its optimizer state is 1/K too).  Checkpoints
hold the full, unsharded model and optimizer state, so they resume on any number of ranks or load into the plain
model.  All the algorithm lives in ``lightning_hpc.hybrid_fc``; this file only translates Lightning hooks.

Large heads: models created under ``Trainer.init_module()`` or in ``LightningModule.configure_model`` (both run
in :meth:`HybridParallelStrategy.tensor_init_context`) get their ``nn.Linear`` layers on the meta device; at setup
each rank allocates only its 1/K shard of every head layer (``nn.Linear``'s initial distribution, full fan-in), so
no rank ever holds the full head.  Checkpoints are gathered to rank 0 one tensor at a time straight into host
memory, and restored after setup from a memory-mapped file, so only each rank's slices are read.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_hpc._compat import averaged_copy, averaging_device, ddp_ignore_parameters, put_whole_averages
from lightning_hpc.distributed.clip import clip_by_global_norm
from lightning_hpc.distributed.copies import tensor_signature
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.distributed.failure import RunFailures
from lightning_hpc.distributed.gradients import allreduce_flat
from lightning_hpc.distributed.groups import MeshDim, build_mesh
from lightning_hpc.distributed.handback import ended_normally, fitting, follow_parameters, rebind_optimizer
from lightning_hpc.distributed.overflow import agree_on_overflow, restore_scaler
from lightning_hpc.distributed.partitioned import follow_split
from lightning_hpc.distributed.sigterm import sigterm_without_collective
from lightning_hpc.distributed.trainability import REBUILD_FIX, TrainableSet
from lightning_hpc.distributed.whole_flat import whole_flat_views
from lightning_hpc.hybrid_fc import (
    FC_UPDATES,
    SCHEMES,
    ByteCounter,
    HeadOptimizer,
    HybridHead,
    find_hybrid_head,
    find_hybrid_heads,
    full_optimizer_state,
    full_state_dict,
    has_meta_head,
    head_parameters,
    linear_layers_on_meta,
    materialize_meta,
    parallelize_head,
    shard_optimizer_state,
    trunk_parameters,
    unparallelize_head,
)
from lightning_hpc.hybrid_fc.autocast_grads import AutocastGradients
from lightning_hpc.protocols import StrategyContract

__all__ = ["HybridParallelStrategy"]

_UNUSED_FIX = (
    "If that is intentional, keep strategy='hybrid_fc' and enable DDP's detection of unused parameters: "
    "HybridParallelStrategy(find_unused_parameters=True), or strategy.find_unused_parameters=true with Hydra "
    "('ddp_find_unused_parameters_true' would replace this strategy by plain DDP)."
)


class HybridParallelStrategy(StrategyContract, DDPStrategy):
    """Data-parallel trunk + model-parallel fully-connected head.

    Args:
        head: name of the head submodule (e.g. ``"classifier"``), or ``None`` to find the trailing run of
            ``nn.Linear`` layers after the last conv/pool/flatten automatically.
        scheme: ``"a"`` (gather all K x b activations), ``"b"`` (ranks take turns broadcasting, overlapped with the
            head's compute) or ``"c"`` (every rank contributes b/K examples to each of K sub-batches).
        fc_update: ``"per_step"`` (exact synchronous SGD on K x b) or ``"per_subbatch"`` (schemes b/c: the head is
            updated after each sub-batch, effective batch (K x b, b), section 4.2; needs a LightningModule with
            ``loss(logits, target)`` and ``(x, y)`` batches, like :class:`lightning_hpc.ImageClassifier`).
        layouts: force the col/row layout of each head layer (default: the cheapest, see ``hybrid_fc/layout.py``).
        model_attr: attribute of the LightningModule to search for the head (``None``, default: the whole
            LightningModule, so ``head`` is a dotted path from it, e.g. ``"model.classifier"``).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "hybrid_fc"
    #: the head is sharded in ``setup`` (after the callbacks' ``setup``): K-FAC attaches in ``on_fit_start``, to the
    #: layers that actually run (before, it hooked the replaced nn.Linear layers, whose hooks never fired)
    replaces_layers_in_setup = True

    def __init__(
        self,
        head: str | None = None,
        scheme: str = "c",
        fc_update: str = "per_step",
        layouts: Sequence[str] | None = None,
        model_attr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"strategy.scheme must be one of {SCHEMES} (section 4 of the paper), got {scheme!r}")
        if fc_update not in FC_UPDATES:
            raise ValueError(f"strategy.fc_update must be one of {FC_UPDATES}, got {fc_update!r}")
        if fc_update == "per_subbatch" and scheme == "a":
            raise ValueError(
                "strategy.fc_update='per_subbatch' needs scheme 'b' or 'c' (scheme 'a' has a single sub-batch)"
            )
        kwargs.setdefault("find_unused_parameters", False)
        destroy_process_group_at_exit()  # gloo's async work must not outlive the interpreter
        super().__init__(**kwargs)
        self._failures = RunFailures("hybrid_fc")
        self._autocast_grads = AutocastGradients()  # the head's gradients rounded as one process's autocast does
        self._user_scaler: torch.amp.GradScaler | None = None  # replaced for the run by agree_on_overflow
        self.head, self.scheme, self.fc_update = head, scheme, fc_update
        self.layouts = list(layouts) if layouts is not None else None
        self.model_attr = model_attr
        self.byte_counter = ByteCounter()
        self._parallelized = False
        self._head_optimizer: HeadOptimizer | None = None
        self._whole_head: contextlib.ExitStack | None = None
        self._unused_checked = False
        self._trainable: TrainableSet | None = None
        #: no DDP: the trunk had no trainable parameter when training started (see configure_ddp)
        self._averages_trunk = False
        #: the head's process group and the LightningModule's tensors (names and shapes) before and after the
        #: split, for splitting the copies weight-averaging callbacks keep alike (:meth:`_split_averages`)
        self._group: dist.ProcessGroup | None = None
        self._signatures: tuple[list[tuple[str, tuple[int, ...]]], ...] = ([], [])
        #: those callbacks and their copies, split this stage (handed back whole with the model)
        self._averages: list[tuple[Any, torch.nn.Module]] = []
        #: the whole-model flat views installed on LBFGS optimizers this stage (removed when handed back whole)
        self._whole_flat: list[Any] = []
        #: the module's parameters by ``id`` before this stage split its head: their names
        self._names_before_split: dict[int, str] = {}

    # -- setup ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()`` / ``configure_model``: linear layers on the meta device (the head is then
        allocated shard by shard at setup), everything else as DDP does; ``empty_init=False`` turns it off."""
        with (
            super().tensor_init_context(empty_init),
            linear_layers_on_meta() if empty_init is not False else contextlib.nullcontext(),
        ):
            yield

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._refuse_weight_averaging_on_meta()

    def _refuse_weight_averaging_on_meta(self) -> None:
        """``WeightAveraging`` / ``EMAWeightAveraging`` move their copy of the LightningModule to its device in their
        ``setup`` (torch's ``AveragedModel``), which runs before the head is allocated shard by shard: a module
        whose layers were built on the meta device (``Trainer.init_module()``) would fail there, inside Lightning,
        naming neither the strategy nor a fix.  Refused here first.  (``StochasticWeightAveraging`` copies without
        moving: its copy gets the model's initial weights when it is split, :meth:`_split_averages`.)"""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if module is None or trainer is None or getattr(trainer.state, "fn", None) != "fit":
            return
        if not _holds_meta(module):
            return
        names = [type(cb).__name__ for cb in getattr(trainer, "callbacks", [])
                 if any(k.__name__ == "WeightAveraging" for k in type(cb).__mro__)]
        if names:
            raise ValueError(
                f"strategy='hybrid_fc': {names[0]} copies the LightningModule to its device when fit starts, and the "
                "module's linear layers are on the meta device (built under Trainer.init_module(), so that each rank "
                "allocates only its shards of the head): the copy has no values to move. Build the module with "
                "Trainer.init_module(empty_init=False) (or outside it), or use StochasticWeightAveraging"
            )

    @override
    def model_to_device(self) -> None:
        # The head is sharded before DDP wraps the model, so DDP ignores the shards and the optimizers see only
        # this rank's 1/K.  A materialised head is sharded after the model reaches its device (NCCL broadcasts need
        # device tensors); a meta-built one before, since a meta tensor cannot be moved: its shards (and any other
        # meta tensor) are allocated on the root device directly.
        inner = self._search_root()
        assert self.lightning_module is not None
        if not self._parallelized and has_meta_head(inner, self.head):
            self._parallelize(device=self.root_device)
            materialize_meta(self.lightning_module, self.root_device)
            super().model_to_device()
            return
        # other linear layers created under tensor_init_context are still on meta: allocate them before moving
        materialize_meta(self.lightning_module, self.root_device)
        super().model_to_device()
        self._parallelize()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore into the sharded model: full tensors are sliced on load, so the full head is never built.
        return True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isfile(checkpoint_path):
            # Memory-mapped: each rank reads only the slices it loads into its shards.
            return torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _head_group(self, device: torch.device | None) -> dist.ProcessGroup:
        """The head's group: the ``"head"`` dimension of a 1-D mesh over the world (one head shard per rank)."""
        dims = [MeshDim("head", what="ranks sharing the fully-connected head")]
        timeout = self._timeout if isinstance(self._timeout, datetime.timedelta) else None
        self._device_mesh = build_mesh(dims, device_type=(device or self.root_device).type, timeout=timeout)
        return self._device_mesh.get_group("head")

    def _parallelize(self, device: torch.device | None = None) -> None:
        if self._parallelized:
            return
        module = self.lightning_module
        assert module is not None
        inner = self._search_root()
        if self.fc_update == "per_subbatch" and not callable(getattr(module, "loss", None)):
            raise ValueError(
                "fc_update='per_subbatch' updates the head inside the forward, so it needs "
                f"{type(module).__name__}.loss(logits, target) "
                "(as lightning_hpc.ImageClassifier has); use fc_update='per_step' for other modules"
            )
        # The head gets its own process group so its collectives never interleave with DDP's buckets.
        # (with the strategy's timeout: torch's default for a new group is 30 minutes, so a dead peer would hang)
        group = self._head_group(device) if dist.is_initialized() else None
        unsplit = _names_and_shapes(module)
        # the module's parameters by name before the split: an earlier fit's optimizers hold them (see teardown)
        self._names_before_split = {id(p): n for n, p in module.named_parameters()}
        root = parallelize_head(
            inner, self.head, self.scheme, self.fc_update, group, self.byte_counter, self.layouts, device=device
        )
        if self.model_attr is not None:  # a new root only when the searched module itself held the head
            setattr(module, self.model_attr, root)
        # a torch.compile'd module calls the split model (dynamo traces it on its first call), the head eagerly
        # (a head that replaced a Sequential is held by its _TrunkThenHead without being registered as a child)
        heads = {id(h): h for m in module.modules() for h in (m, getattr(m, "hybrid_head", None))
                 if isinstance(h, HybridHead)}
        follow_split(module, list(heads.values()))
        shard_ids = {id(p) for p in head_parameters(self._search_root())}
        ignore = [n for n, p in module.named_parameters() if id(p) in shard_ids]
        ddp_ignore_parameters(module, ignore)
        self._group, self._signatures = group, (unsplit, _names_and_shapes(module))
        self._parallelized = True

    @override
    def configure_ddp(self) -> None:
        """DDP for a trunk with trainable parameters.  A trunk with none when training starts (only the head
        trains: a model that is only its fully-connected head, a trunk of parameter-free layers such as Flatten,
        a frozen one, BackboneFinetuning's backbone) has nothing for DDP to reduce, and DDP refuses a module
        without trainable parameters: the trunk's parameters are made equal on every rank (rank 0's, as DDP does)
        and the strategy averages the gradients of whatever trunk parameters train at each step itself
        (:meth:`_average_trunk_gradients`), so a backbone unfrozen later is averaged from that step on."""
        module = self.lightning_module
        assert module is not None
        self._averages_trunk = self.follows_trainability_changes = False
        shard_ids = {id(p) for p in head_parameters(self._search_root())}
        if any(p.requires_grad and id(p) not in shard_ids for p in module.parameters()):
            super().configure_ddp()
            return
        # whatever trains at a step is averaged at that step: a backbone unfrozen later (BackboneFinetuning) is
        # followed, where DDP's reducer is built once, for the parameters trainable when it wrapped the model
        self._averages_trunk = self.follows_trainability_changes = True
        if dist.is_initialized() and self.world_size > 1:
            with torch.no_grad():
                for t in [p for p in module.parameters() if id(p) not in shard_ids] + list(module.buffers()):
                    dist.broadcast(t, src=0)

    def _average_trunk_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Without DDP (:meth:`configure_ddp`): average the gradients of the trainable trunk parameters among
        ``params`` over the ranks (section 4.1), after the backward passes of a step and before anything reads
        them (gradient clipping, ``on_before_optimizer_step``, the step).  Every rank must hold gradients for the
        same parameters (checked: one small all-reduce), or the flat all-reduce would mix different tensors."""
        if not self._averages_trunk or self.world_size < 2 or self.lightning_module is None:
            return
        shard_ids = {id(p) for p in head_parameters(self._search_root())}
        trunk = list({id(p): p for p in params if p.requires_grad and id(p) not in shard_ids}.values())
        if not trunk:
            return
        has = torch.tensor([p.grad is not None for p in trunk], dtype=torch.int32, device=self.root_device)
        agreed = has.clone()
        dist.all_reduce(agreed)
        if not torch.equal(agreed, has * self.world_size):
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            odd = [names.get(id(p), "?") for p, a in zip(trunk, agreed.tolist()) if 0 < a < self.world_size]
            raise RuntimeError(
                f"strategy='hybrid_fc': trunk parameter(s) {odd[:5]} got a gradient on some ranks only (the loss used "
                "them depending on the data), so their average over the ranks is not defined; use every trainable "
                "parameter in every step's loss, or freeze it"
            )
        grads = [p.grad for p in trunk if p.grad is not None]
        allreduce_flat(grads, 1.0 / self.world_size)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._parallelized:
            self._autocast_grads.before_backward(s for h in find_hybrid_heads(self._search_root()) for s in h.shards)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        # before the precision plugin unscales them (a GradScaler's overflow check) and anyone reads them
        self._autocast_grads.after_backward()
        module = self.lightning_module
        if self._averages_trunk and module is not None and not module.automatic_optimization:
            # manual optimization: every manual_backward is synchronised, as DDP synchronises it (the user may clip
            # or step right after it); averaging a gradient already averaged leaves it as it is
            self._average_trunk_gradients(p for o in self.optimizers for g in o.param_groups for p in g["params"])

    @override
    def setup(self, trainer: Any) -> None:
        sigterm_without_collective(trainer)  # SIGTERM ends every rank promptly (no collective in its handler)
        self._failures.start()  # a failing rank's message reaches every peer promptly
        super().setup(trainer)
        # a GradScaler skips a step when any rank's shard overflowed, as one process skips it
        self._user_scaler = agree_on_overflow(self.precision_plugin, self.root_device.type)
        self._refuse_per_subbatch_lbfgs()
        # LBFGS computes with flat vectors of every parameter: the whole model's on every rank (the head's blocks
        # gathered, the loss the global batch's), so every rank takes one process's step; the trunk is averaged
        # over every rank, the world
        self._whole_flat = whole_flat_views(self.optimizers, None) if self._parallelized else []
        self._split_averages(trainer.callbacks)
        if self.lightning_module is not None:  # what DDP's reducer was built for (configure_ddp ran in setup)
            self._trainable = TrainableSet(self.lightning_module)
        # gradient_clip_val / clip_gradients by norm: the norm of the whole model (trunk once, every shard once),
        # the same on every rank; a per-rank norm would let the trunk replicas drift apart
        self.precision_plugin.clip_grad_by_norm = clip_by_global_norm(  # type: ignore[method-assign, assignment]
            lambda: head_parameters(self._search_root())
        )
        if self.fc_update == "per_subbatch" and self.optimizers:
            if len(self.optimizers) != 1:
                raise ValueError("fc_update='per_subbatch' supports exactly one optimizer")
            self._head_optimizer = HeadOptimizer(self.optimizers[0], head_parameters(self._search_root()))

    def _refuse_per_subbatch_lbfgs(self) -> None:
        """The per-sub-batch update steps the head by its own optimizer step after every sub-batch, inside the
        forward pass, without a closure; LBFGS re-evaluates the loss through a closure at every step."""
        if self.fc_update == "per_subbatch" and any(
            isinstance(getattr(o, "optimizer", o), torch.optim.LBFGS) for o in self.optimizers
        ):
            raise ValueError(
                "strategy='hybrid_fc' with fc_update='per_subbatch' steps the head after every sub-batch, inside the "
                "forward pass, where torch.optim.LBFGS needs to re-evaluate the loss through its closure. Use "
                "fc_update='per_step' (the default: LBFGS then trains as on one process), or a first-order optimizer"
            )

    def _split_averages(self, callbacks: Sequence[Any]) -> None:
        """The copy of the LightningModule each weight-averaging callback keeps (``StochasticWeightAveraging``,
        ``WeightAveraging`` / ``EMAWeightAveraging``: made in the callback's ``setup``, which runs before this one)
        split as the model is: the same head layers, layouts, blocks and process group.  The callbacks only copy
        tensors between the two, element by element in ``parameters()`` (and ``buffers()``) order (averaging after
        a step or an epoch, swapping the average in around validation, copying it into the model at the end), so
        each rank pairs its blocks with the same blocks of the copy, as one process pairs whole tensors; the copy
        is never called.  A copy made while the head was on the meta device (``Trainer.init_module``) holds no
        values: it gets the model's as they start, which is what the callback copied on one process."""
        self._averages = []
        module = self.lightning_module
        if not self._parallelized or module is None:
            return
        unsplit, split = self._signatures
        for callback in callbacks:
            copy = averaged_copy(callback)
            if copy is None:
                continue
            name = type(callback).__name__
            where = averaging_device(callback)
            if where is not None and not _usable(where):  # Lightning would fail there at swa_epoch_start, mid-run
                raise ValueError(
                    f"strategy='hybrid_fc': {name} keeps its averaged copy of the LightningModule on {where}, which "
                    f"this process cannot use (training runs on {self.root_device}), so averaging would fail once it "
                    f"starts. Pass {name}(..., device=None) (the copy then lives on the training device) or a device "
                    "this process has"
                )
            if _names_and_shapes(copy) != unsplit:
                raise ValueError(
                    f"strategy='hybrid_fc': the copy of the LightningModule {name} made in its setup does not hold "
                    "the module's parameters and buffers as training starts (the module changed after the callback "
                    "copied it: in LightningModule.setup or configure_model), so it cannot be split as the model is "
                    "and averaging would pair different tensors. Build the layers in __init__, or train with "
                    "strategy='ddp'"
                )
            meta = _holds_meta(copy)
            if meta:
                copy.to_empty(device=self.root_device)  # its values are the model's, set below
            else:
                copy.to(self.root_device)
            root = copy if self.model_attr is None else getattr(copy, self.model_attr)
            layouts = find_hybrid_head(self._search_root()).layouts
            # the per-step head (the copy is never trained), without an exchange group of its own (never called)
            split_root = parallelize_head(root, self.head, self.scheme, "per_step", self._group, None, layouts,
                                          device=self.root_device, overlap=False)
            if self.model_attr is not None:
                setattr(copy, self.model_attr, split_root)
            if _names_and_shapes(copy) != split:
                raise ValueError(
                    f"strategy='hybrid_fc': the copy of the LightningModule {name} keeps was split otherwise than the "
                    "model (another head was found in it), so averaging would pair different blocks. Name the head: "
                    "HybridParallelStrategy(head='<dotted.path>'), or train with strategy='ddp'"
                )
            if meta:
                with torch.no_grad():
                    for mine, model in zip([*copy.parameters(), *copy.buffers()],
                                           [*module.parameters(), *module.buffers()]):
                        mine.copy_(model)
            follow_split(copy, find_hybrid_heads(root))
            if where is not None and where != self.root_device:
                # where the callback keeps it (StochasticWeightAveraging's default: the host); its blocks travel
                # through the training device whenever they are gathered (checkpoints, the hand-back)
                copy.to(where)
            self._averages.append((callback, copy))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._refuse_short_last_batch()

    def _refuse_short_last_batch(self) -> None:
        """The per-sub-batch update of scheme 'c' steps the head once for each of the K slices of every rank's
        batch (section 4.2): a last batch of fewer than K samples per rank (the training set's per-rank share not a
        multiple of the batch size) has fewer slices, so it would stop training when it comes, after the epoch's
        other steps.  Found here, before the first step, from the loaders' lengths and batch size.  (The per-step
        update runs such a batch as one sub-batch, scheme 'a': the same step.)"""
        per_subbatch_c = self.scheme == "c" and self.fc_update == "per_subbatch"
        if not per_subbatch_c or self.world_size < 2 or self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        short = last_batch_sizes(trainer, self.world_size)
        bad = [(n, b, last) for n, b, last in short if 0 < last < self.world_size]
        if bad:
            n, b, last = bad[0]
            raise ValueError(
                f"strategy='hybrid_fc' (scheme='c'): each epoch's last training batch holds {last} sample(s) per rank "
                f"({n} samples per rank in batches of {b}), and scheme 'c' splits every rank's batch into K="
                f"{self.world_size} slices, one head update each (fc_update='per_subbatch', section 4.2). Use "
                "DataLoader(..., drop_last=True), a training set whose per-rank share is a multiple of the batch "
                "size, HybridParallelStrategy(scheme='b'), or fc_update='per_step'"
            )

    @override
    def on_predict_start(self) -> None:
        # Lightning's predict sampler gives the ranks unequal numbers of samples and batches (no padding, so no
        # duplicated predictions); the sharded forward needs every rank in each batch, so predict runs the whole
        # head on each rank instead (gathered once here, dropped at the end)
        super().on_predict_start()
        if self.world_size > 1 and self._parallelized:
            self._whole_head = contextlib.ExitStack()
            # every split head: the model's and its frozen copies' (an EMA predicts as the model does)
            size = sum(self._whole_head.enter_context(h.whole_head_inference())
                       for h in find_hybrid_heads(self._search_root()))
            rank_zero_info(
                f"strategy='hybrid_fc': trainer.predict runs the whole fully-connected head on every rank "
                f"({size / 2**20:.1f} MiB gathered once), so the ranks' unequal predict batches need no exchange"
            )

    @override
    def on_predict_end(self) -> None:
        if self._whole_head is not None:
            self._whole_head.close()
            self._whole_head = None
        super().on_predict_end()

    @override
    def teardown(self) -> None:
        self._hand_back_model()
        self._failures.stop()
        restore_scaler(self.precision_plugin, self._user_scaler)
        self._user_scaler = None
        module = self.lightning_module
        if module is None or not _holds_meta(module):
            super().teardown()
            return
        # a run that stopped before the head was allocated (a refusal, a callback's error) with layers built on the
        # meta device: Lightning's teardown moves the module to the host, which a meta tensor cannot do, and that
        # error would replace the run's own; those tensors stay where they are
        module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu

    def _hand_back_model(self) -> None:
        """At the end of every stage (fit / validate / test / predict) that ended normally on every rank: the
        user's head container back in its place with the full trained weights in its ``nn.Linear`` layers, on
        every rank, and the optimizers rebound to them with their state gathered to full shape (see
        :mod:`lightning_hpc.distributed.handback`); after a stage other than fit, an earlier fit's optimizers follow
        the module's parameters into the whole head, with their state.  Costs the full head (and its optimizer
        state) in host memory on every rank; the next stage splits the model again."""
        module = self.lightning_module
        if not self._parallelized or module is None or not ended_normally(module):
            return
        # Fit's optimizers are over the split head: their state gathered to full shape first, straight to host
        # memory (Lightning's teardown moves the model and optimizers there next). After another stage they are over
        # the module as the last fit handed it back (this stage split it again and steps nothing): they follow its
        # parameters by name into the whole head.
        fit = fitting(module)
        states = [full_optimizer_state(o, module, rank0_only=False, cpu=True) for o in self.optimizers] if fit else []
        root, replaced = unparallelize_head(self._search_root(), cpu=True)
        if self.model_attr is not None:
            setattr(module, self.model_attr, root)
        follow_split(module)
        if fit:
            for optimizer, state in zip(self.optimizers, states, strict=True):
                params = [[replaced.get(id(p), p) for p in group["params"]] for group in optimizer.param_groups]
                rebind_optimizer(optimizer, params, state)
        else:
            for optimizer in self.optimizers:
                follow_parameters(optimizer, self._names_before_split, module)
        self._names_before_split = {}
        for view in self._whole_flat:  # the optimizer is over whole parameters again
            view.remove()
        self._whole_flat = []
        ddp_ignore_parameters(module, [])  # a later plain DDP run of this module reduces the head again
        for _, copy in self._averages:  # weight averaging's copies: whole again, where the callback keeps them
            on_host = next(iter([*copy.parameters(), *copy.buffers()]), torch.empty(())).device.type == "cpu"
            root, _ = unparallelize_head(copy if self.model_attr is None else getattr(copy, self.model_attr),
                                         cpu=on_host, device=self.root_device)
            if self.model_attr is not None:
                setattr(copy, self.model_attr, root)
            follow_split(copy)
        self._averages = []
        self._parallelized = False
        self._head_optimizer = None

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def checked_closure() -> Any:
            result = closure()
            module = self.lightning_module
            if self._averages_trunk:  # no DDP: whatever trains now is averaged now
                if module is not None and module.automatic_optimization:
                    self._average_trunk_gradients(p for g in optimizer.param_groups for p in g["params"])
                return result
            if self._trainable is not None and self.lightning_module is not None:
                # before the step: DDP reduces only the parameters trainable when it wrapped the model
                self._trainable.refuse_changes(self.lightning_module, "strategy='hybrid_fc'", REBUILD_FIX)
            self._refuse_unused_trunk_parameters()
            return result

        return super().optimizer_step(optimizer, checked_closure, model, **kwargs)

    def _refuse_unused_trunk_parameters(self) -> None:
        """Before the first optimizer step: a trainable trunk parameter that got no gradient left DDP's bucket
        holding it unreduced (its other gradients local, the step silently different), and DDP itself complains
        only at the next forward, after the step.  Refuse here instead, naming the parameter and the fix."""
        if self._unused_checked or self._averages_trunk or self._ddp_kwargs.get("find_unused_parameters", False):
            return
        module = self.lightning_module
        assert module is not None
        names = {id(p): n for n, p in module.named_parameters()}
        unused = [names[id(p)] for p in trunk_parameters(module) if p.requires_grad and p.grad is None]
        self._unused_checked = True
        if unused:
            raise RuntimeError(
                f"strategy='hybrid_fc': trunk parameter(s) {unused[:5]} of {type(module).__name__} took no part in "
                "the loss returned by training_step, so DDP left their bucket unreduced. " + _UNUSED_FIX
            )

    @property
    def kfac_unsupported(self) -> str | None:
        """The :class:`~lightning_hpc.KFAC` callback preconditions the sharded head layers as whole layers (their
        factors and gradients gathered at the step, :class:`lightning_hpc.kfac.layers.ShardedLinearHandler`), which
        needs the head's gradients of the optimizer step: the per-sub-batch update steps the head inside the forward
        pass instead."""
        if self.fc_update == "per_subbatch":
            return (
                "KFAC under strategy='hybrid_fc' with fc_update='per_subbatch': the head is updated by its own "
                "optimizer step after every sub-batch, inside the forward pass, where K-FAC preconditions once per "
                "optimizer step with the whole step's factors. Use fc_update='per_step' (the default: the whole head "
                "is preconditioned as on one process), or remove the KFAC callback"
            )
        return None

    def _search_root(self) -> torch.nn.Module:
        """The module searched for the head: the LightningModule, or its ``model_attr`` attribute."""
        module = self.lightning_module
        assert module is not None
        if self.model_attr is None:
            return module
        inner = getattr(module, self.model_attr, None)
        if not isinstance(inner, torch.nn.Module):
            raise ValueError(
                f"HybridParallelStrategy(model_attr={self.model_attr!r}): {type(module).__name__} has no nn.Module "
                "there; leave model_attr unset to search the whole LightningModule"
            )
        return inner

    # -- training --------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.fc_update != "per_subbatch" or self._head_optimizer is None:
            return super().training_step(*args, **kwargs)
        batch = kwargs.get("batch", args[0] if args else None)
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError("fc_update='per_subbatch' needs (inputs, targets) batches")
        head = find_hybrid_head(self._search_root())
        assert self.lightning_module is not None
        # found callable in _parallelize; nn.Module's __getattr__ types it as a tensor or module
        loss_fn = cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], self.lightning_module.loss)
        with head.subbatch_update(batch[1], loss_fn, self._head_optimizer.step):
            return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        unused = "Expected to have finished reduction in the prior iteration" in str(exception)
        super().on_exception(exception)
        if unused:  # Lightning's DDP advice names DDP's own strategy strings, which would drop the sharded head
            exception.args = (
                "A parameter of the data-parallel trunk took no part in the loss returned by training_step. "
                + _UNUSED_FIX,
            )
        self._failures.share(exception)


    # -- checkpoints: full, unsharded ------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        if not self._parallelized:  # handed back whole (after a stage): the user's module as it is
            return super().lightning_module_state_dict()
        # Only rank 0 writes the file: gather there, one tensor at a time, straight to host memory.
        return full_state_dict(module, rank0_only=True, cpu=True)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Weight averaging's copy, split as the model is (:meth:`_split_averages`), whole in the checkpoint (the
        callbacks put its ``state_dict()``, this rank's blocks, there after the model's was gathered):
        ``StochasticWeightAveraging``'s ``average_model_state`` in its callback state, and the average that
        ``WeightAveraging`` writes as the checkpoint's ``state_dict`` (the model's under ``current_model_state``).
        Collective: every rank saves (only rank 0 writes)."""
        # (split this stage; emptied when handed back whole)
        put_whole_averages(checkpoint, self._averages,
                           lambda copy: full_state_dict(copy, rank0_only=True, cpu=True, device=self.root_device))
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        assert self.lightning_module is not None
        if not self._parallelized:  # rebound to the whole parameters when the model was handed back
            return super().optimizer_state(optimizer)
        return full_optimizer_state(optimizer, self.lightning_module, rank0_only=True, cpu=True)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        states = [
            shard_optimizer_state(s, o, self.lightning_module)
            for o, s in zip(self.optimizers, checkpoint["optimizer_states"])
        ]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})


def _usable(device: torch.device) -> bool:
    """Whether this process can put tensors on ``device`` (a CUDA device in a CPU-only build cannot)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError):  # torch raises AssertionError for a backend it was built without
        return False
    return True


def _holds_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built under ``Trainer.init_module``)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _names_and_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The names and shapes of ``module``'s parameters then buffers (not their dtypes: a precision plugin converts
    the LightningModule after weight averaging copied it, and the callbacks average across dtypes)."""
    return [(name, shape) for name, shape, _ in tensor_signature(module)]


def last_batch_sizes(trainer: Any, ranks: int) -> list[tuple[int, int, int]]:
    """(samples per rank, batch size, samples in the last batch) of every training DataLoader whose last batch the
    run reaches (``limit_train_batches`` / ``max_steps`` may stop before it)."""
    from torch.utils.data import DataLoader

    out = []
    loaders = getattr(trainer, "train_dataloader", None)
    flat = getattr(loaders, "flattened", None) or ([loaders] if loaders is not None else [])
    for loader in flat:
        if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
            continue
        try:
            per_rank = len(loader.sampler)  # type: ignore[arg-type]
        except TypeError:
            continue
        batches = -(-per_rank // loader.batch_size)
        reached = trainer.num_training_batches >= batches and (
            trainer.max_steps == -1 or trainer.max_steps * trainer.accumulate_grad_batches >= batches)
        if reached:
            out.append((per_rank, loader.batch_size, per_rank % loader.batch_size))
    return out

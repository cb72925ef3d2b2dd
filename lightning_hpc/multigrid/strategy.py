"""Lightning adapter: ``Trainer(strategy="multigrid")`` / ``MultigridStrategy(...)``.

Translates Lightning hooks only; the algorithm lives in the plain-torch modules of this package.

* ranks form a data x layer mesh (``layer_parallel_size`` ranks per layer chain); the sampler shards data
  over the data dimension only (the ranks of one chain see the same batch);
* the model's residual trunk (attribute ``trunk``, default ``steps`` as in ``ODEResNet``) is replaced by a
  :class:`MultigridODEBlock` (or the partitioned-model baseline with ``mode="pm"``) holding only this layer
  rank's steps (sharded.py), before the optimizers are built: parameters, gradients and optimizer state of the
  trunk are 1/P per rank;
* copies of the trunk the user keeps in the LightningModule (an EMA's ``copy.deepcopy`` of the model, found by
  their tensors: distributed/copies.py) are split alike, so an element-wise update of the copy from the model's
  ``state_dict`` pairs the same steps, and the copy runs (collectively) where the user calls it;
* a model without a ``steps`` attribute (``trunk`` not set: Lightning's demo modules, a classifier without a
  chain of residual steps) has nothing to split over layer ranks: it trains data parallel over every rank, as
  DDP does, with a warning; a ``trunk`` the user names must exist;
* after backward, gradients are averaged over the data dimension (each layer rank owns its steps' gradients);
* checkpoints are what one process training the serial model would write: the full model (the trunk gathered,
  serial key names) and the optimizer state in the serial layout (checkpoint.py), gathered onto global rank 0;
  resuming re-shards both onto any ``layer_parallel_size`` (1 and a plain one-process Trainer included);
* the per-cycle residual norms of the forward solve (and of the previous step's adjoint solve) are logged as
  ``multigrid/forward_residual_<cycle>`` and ``multigrid/backward_residual_<cycle>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hpc._compat import averaged_copy, ddp_ignore_parameters, put_whole_averages
from lightning_hpc.distributed.clip import clip_by_global_norm
from lightning_hpc.distributed.copies import copies_of
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.distributed.failure import RunFailures
from lightning_hpc.distributed.handback import ended_normally, fitting, follow_parameters, rebind_optimizer
from lightning_hpc.distributed.overflow import agree_on_overflow, restore_scaler
from lightning_hpc.distributed.partitioned import follow_split
from lightning_hpc.distributed.sigterm import sigterm_without_collective
from lightning_hpc.distributed.start_equal import module_state_tensors, start_equal
from lightning_hpc.distributed.whole_flat import whole_flat_views
from lightning_hpc.multigrid.checkpoint import (
    full_optimizer_state,
    local_optimizer_state,
    serial_optimizer,
)
from lightning_hpc.multigrid.function import MultigridODEBlock
from lightning_hpc.multigrid.options import MultigridOptions, SolveSettings
from lightning_hpc.multigrid.parallel import average_gradients, layer_data_mesh
from lightning_hpc.multigrid.partition import check_layer_partition
from lightning_hpc.multigrid.pm import PartitionedODEBlock
from lightning_hpc.multigrid.sharded import (
    LayerShardedTrunk,
    full_model_state_dict,
    release_other_steps,
    restore_trunk,
)
from lightning_hpc.protocols import StrategyContract

__all__ = ["MultigridStrategy"]

MODES = ("mg", "pm", "serial")
#: key of the per-layer-rank optimizer states in the ``optimizer_states`` entries of earlier versions' checkpoints
LAYER_SHARDS = "multigrid_layer_shards"


class MultigridStrategy(StrategyContract, DDPStrategy):
    """Layer-parallel multigrid training (Kirby et al.), optionally combined with data parallelism.

    Args:
        layer_parallel_size: ranks per layer chain (default: all ranks); the world size must be a multiple.
        cfactor, levels, relaxation: the hierarchy (see :class:`MultigridOptions`).
        forward_cycles, forward_tol, backward_cycles, backward_tol: stopping rules of the two solves.
        mode: "mg" (multigrid), "pm" (partitioned model: same partition, serial evaluation) or "serial"
            (no change to the model; data parallelism only).
        trunk: attribute path of the residual trunk inside ``lightning_module.model``; ``None`` (the default):
            ``steps`` where the model has it (``ODEResNet``), else no trunk: the model trains data parallel over
            every rank, with a warning.
        concurrent: batch the blocks of a relaxation in one vmapped call (False: block after block).
        coarse_gather_threshold: gather the coarsest level onto every layer rank and solve it there when it
            has at most this many steps (0: never; it is propagated rank after rank), see coarse.py.
    """

    strategy_name = "multigrid"

    def __init__(
        self,
        layer_parallel_size: int | None = None,
        cfactor: int = 4,
        levels: int = 2,
        relaxation: str = "F",
        forward_cycles: int = 2,
        forward_tol: float | None = None,
        backward_cycles: int = 2,
        backward_tol: float | None = None,
        mode: str = "mg",
        trunk: str | None = None,
        concurrent: bool = True,
        coarse_gather_threshold: int = 0,
        log_residuals: bool = True,
        timeout: timedelta | None = timedelta(seconds=1800),
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layer_parallel_size is not None and layer_parallel_size < 1:
            raise ValueError(f"layer_parallel_size must be >= 1, got {layer_parallel_size}")
        destroy_process_group_at_exit()  # gloo's async work must not outlive the interpreter
        super().__init__(timeout=timeout, **kwargs)
        self._failures = RunFailures("multigrid")
        self._user_scaler: torch.amp.GradScaler | None = None  # replaced for the run by agree_on_overflow
        # validated now so a bad setting fails before any process is started
        self.options = MultigridOptions(
            cfactor=cfactor,
            levels=levels,
            relaxation=relaxation,
            forward=SolveSettings(forward_cycles, forward_tol),
            backward=SolveSettings(backward_cycles, backward_tol),
            concurrent=concurrent,
            coarse_gather_threshold=coarse_gather_threshold,
        )
        self.layer_parallel_size_setting = layer_parallel_size
        self.mode, self.trunk, self.log_residuals = mode, trunk, log_residuals
        self.data_group: dist.ProcessGroup | None = None
        self.layer_group: dist.ProcessGroup | None = None
        self._data_index, self._layer_index = 0, 0
        self.block: nn.Module | None = None
        #: the model has no trunk (``trunk`` not set and no ``steps``): data parallel over every rank this stage
        self._trunkless = False
        #: the trunk's path in the LightningModule (and in the copies weight averaging makes of it)
        self._trunk_path = ""
        #: (parent, attribute, the user's trunk, its split block) of the trunk and of its copies while they are
        #: replaced; handed back at teardown
        self._user_trunks: list[tuple[nn.Module, str, nn.Module, LayerShardedTrunk]] = []
        #: the weight-averaging callbacks whose copies of the module are split this stage (:meth:`save_checkpoint`)
        self._averages: list[tuple[Any, nn.Module]] = []
        #: the module's parameters by ``id`` before this stage split its trunk: their names
        self._names_before_split: dict[int, str] = {}
        #: the whole-model flat views installed on LBFGS optimizers this stage (removed when handed back whole)
        self._whole_flat: list[Any] = []

    @property
    def kfac_unsupported(self) -> str | None:
        """Why the :class:`~lightning_hpc.KFAC` callback cannot run with this strategy (``None``: it can)."""
        if self.mode == "serial":
            return None  # the model is left unchanged
        return (
            f"KFAC does not support strategy='multigrid' with mode={self.mode!r}: the trunk is replaced by a "
            "layer-parallel block that holds only this rank's steps and runs each step's layers several times per "
            "forward (relaxation sweeps, coarse levels), so K-FAC's per-layer factors would be wrong. Remove the "
            "KFAC callback, or use K-FAC with strategy='ddp' or 'layered_sgd'"
        )

    # -- sizes and sampler ---------------------------------------------------------------------------------
    @property
    def layer_parallel_size(self) -> int:
        if self._trunkless:
            return 1
        return self.layer_parallel_size_setting or self.world_size

    @property
    def data_parallel_size(self) -> int:
        return max(self.world_size // self.layer_parallel_size, 1)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of a layer chain must see the same samples: shard over the data dimension only
        return {"num_replicas": self.data_parallel_size, "rank": self._data_index}

    # -- model setup (instead of DDP wrapping) ------------------------------------------------------------
    def _find_trunk(self) -> tuple[nn.Module, str, nn.Module] | None:
        """(parent, attribute, trunk); None when ``trunk`` is not set and the model has no ``steps``."""
        module = self.lightning_module
        assert module is not None
        root = getattr(module, "model", module)
        *path, name = (self.trunk or "steps").split(".")
        parent = root
        for part in path:
            parent = getattr(parent, part, None)
        trunk = getattr(parent, name, None)
        if trunk is None and self.trunk is None:
            return None
        if trunk is None:
            raise ValueError(
                f"MultigridStrategy(trunk={self.trunk!r}): the model ({type(root).__name__}) has no attribute "
                f"{self.trunk!r}; set trunk= to the attribute holding the nn.Sequential of residual steps "
                "(ODEResNet calls it 'steps'), or leave trunk unset to train a model without one data parallel"
            )
        assert parent is not None
        return parent, name, trunk

    def _warn_trunkless(self) -> None:
        module = self.lightning_module
        root = getattr(module, "model", module)
        if self.mode != "serial":
            rank_zero_warn(
                f"strategy='multigrid': the model ({type(root).__name__}) has no residual trunk (no attribute "
                f"'steps', where ODEResNet holds its steps), so nothing is layer-parallel: it trains data parallel "
                f"over all {self.world_size} ranks, as DDP does. To split a chain of residual steps over the layer "
                "ranks, set trunk= to the attribute holding its nn.Sequential"
            )

    def _check_sizes(self) -> None:
        if self.world_size % self.layer_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by layer_parallel_size={self.layer_parallel_size}; "
                f"use a world size that is a multiple of {self.layer_parallel_size}, or change layer_parallel_size"
            )
        if self.mode == "serial" and self.layer_parallel_size != 1:
            raise ValueError(
                "mode='serial' runs every layer on every rank: set layer_parallel_size=1 (got "
                f"{self.layer_parallel_size})"
            )

    def _wrap_model(self) -> None:
        if self.block is not None or self._trunkless:
            return
        found = self._find_trunk()
        self._trunkless = found is None
        self._check_sizes()
        if found is None:
            self._warn_trunkless()
        else:
            self._check_precision()  # the solver's precision: a model without a trunk runs no solver
            levels = self.options.levels if self.mode == "mg" else 1
            trunk = found[2]
            n_steps = len(trunk) if isinstance(trunk, (nn.Sequential, nn.ModuleList)) else 0
            check_layer_partition(n_steps, self.layer_parallel_size, self.options.cfactor, levels)
        assert self.lightning_module is not None  # _find_trunk checked it
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            device_type = self.root_device.type
            mesh = layer_data_mesh(self.layer_parallel_size, device_type)
            rank, lp = dist.get_rank(), self.layer_parallel_size
            self._device_mesh = mesh
            self.data_group, self.layer_group = mesh.get_group("data"), mesh.get_group("layer")
            self._data_index, self._layer_index = rank // lp, rank % lp
            # no DDP wrapper broadcasts the initial weights: do it here so every replica starts equal
            start_equal(module_state_tensors(self.lightning_module))
        if found is None:
            return  # data parallel: post_backward averages every gradient over the data group (all ranks)
        module = self.lightning_module
        # found on the unsplit model (an EMA's deepcopy of it), from the trunk's path (through a compiled wrapper)
        self._trunk_path = next(n for n, m in module.named_modules(remove_duplicate=False) if m is found[2])
        copies = copies_of(module, self._trunk_path)
        # the module's parameters by name before the split: an earlier fit's optimizers hold them (see teardown)
        self._names_before_split = {id(p): n for n, p in module.named_parameters()}
        self.block = self._split(*found)
        for copy in copies:
            self._split_at(module, copy.path)
        # a torch.compile'd module calls the trunk now in its place, which runs eagerly between compiled parts
        follow_split(module, [block for *_, block in self._user_trunks] or [self.block])
        if self._user_trunks:
            # each rank holds different steps under different names: never broadcast them from rank 0
            block_ids = {id(t) for *_, block in self._user_trunks for t in [*block.parameters(), *block.buffers()]}
            local = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if id(t) in block_ids]
            ddp_ignore_parameters(module, local)

    def _split_at(self, root: nn.Module, path: str) -> nn.Module:
        """:meth:`_split` of the trunk at ``path`` in ``root`` (a copy of the trunk: one kept in the module, or
        the copy of the module a weight-averaging callback keeps)."""
        parent_path, _, attr = path.rpartition(".")
        return self._split(root.get_submodule(parent_path) if parent_path else root, attr, root.get_submodule(path))

    def _split(self, parent: nn.Module, name: str, trunk: nn.Module) -> nn.Module:
        """Put the block of ``mode`` in the place of ``trunk`` (``parent.name``): this rank's steps only."""
        layer_group = self.layer_group if self.layer_parallel_size > 1 else None
        block: nn.Module
        if self.mode == "mg":
            block = MultigridODEBlock(trunk, self.options, group=layer_group)
        elif self.mode == "pm":
            block = PartitionedODEBlock(trunk, group=layer_group)
        else:
            return trunk
        setattr(parent, name, block)
        assert isinstance(block, LayerShardedTrunk)
        self._user_trunks.append((parent, name, trunk, block))
        release_other_steps(block, trunk)  # the other ranks' steps: modules kept, memory freed
        return block

    def _check_precision(self) -> None:
        """mode='mg' relaxes the steps with stacked weights outside autocast's reach (torch.func + vmap), so an
        autocast precision would mix dtypes inside the solver: refused before training, with the choices that
        work named.  mode='pm' evaluates the steps one after another and runs under autocast."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if self.mode == "mg" and precision.endswith("-mixed"):
            raise ValueError(
                f"strategy='multigrid' with mode='mg' does not support precision={precision!r} (autocast does not "
                "reach "
                "the multigrid solver's batched steps); use precision='32-true' (or '64-true', 'bf16-true'), or "
                "mode='pm' / 'serial', which run under autocast"
            )

    @override
    def configure_ddp(self) -> None:
        self._wrap_model()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failures.share(exception)  # every rank ends promptly with the failing rank's message


    @override
    def setup(self, trainer: Any) -> None:
        sigterm_without_collective(trainer)  # SIGTERM ends every rank promptly (no collective in its handler)
        self._failures.start()  # a failing rank's message reaches every peer promptly
        super().setup(trainer)
        self._wrap_model()  # also when validating / testing only (DDPStrategy skips configure_ddp then)
        if self._sharded() is not None:
            # a GradScaler skips a step when any rank's steps overflowed, as one process skips it
            self._user_scaler = agree_on_overflow(self.precision_plugin, self.root_device.type)
            # LBFGS computes with flat vectors of every parameter: the whole model's on every rank (the steps'
            # gradients gathered over the layer group, the loss averaged over the data group), so every rank takes
            # one process's step
            self._whole_flat = whole_flat_views(self.optimizers, self.data_group)
            # weight averaging (StochasticWeightAveraging, EMAWeightAveraging) copied the unsplit module in its
            # setup, before this one: its copy is split alike, so averaging, swapping in and transferring the
            # averaged weights pair this rank's steps with the same steps
            self._averages = [(c, copy) for c in trainer.callbacks if (copy := averaged_copy(c)) is not None]
            for _, copy in self._averages:
                self._split_at(copy, self._trunk_path)
        # gradient_clip_val / clip_gradients by norm: each rank of a layer chain holds only its steps, so the
        # norm counts the replicated parameters once and every rank's steps once
        self.precision_plugin.clip_grad_by_norm = clip_by_global_norm(  # type: ignore[method-assign, assignment]
            lambda: list(sharded.parameters()) if (sharded := self._sharded()) is not None else [],
            lambda: self.layer_group,
        )

    @override
    def teardown(self) -> None:
        self._hand_back_model()
        self._trunkless = False  # the next stage looks for the trunk again (it may run another module)
        self._failures.stop()
        restore_scaler(self.precision_plugin, self._user_scaler)
        self._user_scaler = None
        super().teardown()

    def _hand_back_model(self) -> None:
        """At the end of every stage (fit / validate / test / predict) that ended normally on every rank: the
        user's trunk back in its place, holding every step with its trained weights on every rank (gathered over
        the layer group), and the optimizers rebound to the serial model's parameters with the serial state (see
        :mod:`lightning_hpc.distributed.handback`); after a stage other than fit, an earlier fit's optimizers follow
        the module's parameters into the restored trunk, with their state.  Costs the whole trunk (and its optimizer
        state) on every rank; the next stage splits the trunk again."""
        module = self.lightning_module
        if module is None or not self._user_trunks or not ended_normally(module):
            return
        # Fit's optimizers are over the sharded trunk: their serial state and parameter names first, found through
        # it. After another stage they are over the module as the last fit handed it back (this stage split it
        # again and steps nothing): they follow its parameters by name into the restored module.
        fit = fitting(module)
        serial = [(o, *serial_optimizer(o, module)) for o in self.optimizers] if fit else []
        replaced: dict[int, nn.Parameter] = {}
        for parent, name, trunk, block in self._user_trunks:
            replaced.update(restore_trunk(block, trunk))
            setattr(parent, name, trunk)
        follow_split(module)
        if not fit:
            for optimizer in self.optimizers:
                follow_parameters(optimizer, self._names_before_split, module)
        elif replaced:
            named = dict(module.named_parameters())
            for optimizer, state, layout, mine in serial:
                # parameters outside the module (unnamed) are replicated: the optimizer's own objects
                own = {n: p for names, g in zip(mine, optimizer.param_groups) for (n, _), p in zip(names, g["params"])}
                own.update(named)
                rebind_optimizer(optimizer, [[own[n] for n in names] for names in layout], state)
        for view in self._whole_flat:  # the optimizer is over the whole model's parameters again
            view.remove()
        self._whole_flat = []
        ddp_ignore_parameters(module, [])  # a later plain DDP run of this module broadcasts the trunk again
        self.block, self._user_trunks, self._averages, self._names_before_split = None, [], [], {}

    # -- gradients, logging, checkpoints ----------------------------------------------------------------------
    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.lightning_module is not None
        average_gradients(list(self.lightning_module.parameters()), self.data_group)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        previous_backward = list(getattr(self.block, "backward_history", []))
        out = super().training_step(*args, **kwargs)
        if self.log_residuals and isinstance(self.block, MultigridODEBlock):
            module = self.lightning_module
            assert module is not None
            for i, value in enumerate(self.block.forward_history):
                module.log(f"multigrid/forward_residual_{i}", value, on_step=True, on_epoch=False)
            for i, value in enumerate(previous_backward):
                module.log(f"multigrid/backward_residual_{i}", value, on_step=True, on_epoch=False)
        return out

    def _sharded(self) -> LayerShardedTrunk | None:
        block = self.block
        return block if isinstance(block, LayerShardedTrunk) and block.chain.size > 1 else None

    def _writes_checkpoint(self, sharded: LayerShardedTrunk) -> bool:
        """Whether this rank's layer chain holds global rank 0, the rank that writes checkpoints (its chain's
        first rank); the other chains need not gather anything."""
        return 0 in sharded.chain.ranks

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model, with the serial model's keys: the trunk gathered onto global rank 0 (collective over
        its layer chain; the other chains keep their local state)."""
        sharded = self._sharded()
        if sharded is None or not self._writes_checkpoint(sharded):
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        return full_model_state_dict(self.lightning_module, dst=0)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Weight averaging's copy, split as the model is (:meth:`setup`), whole in the checkpoint (the callbacks
        put its ``state_dict()``, this rank's steps, there): ``StochasticWeightAveraging``'s
        ``average_model_state`` in its callback state, and the average that ``WeightAveraging`` writes as the
        checkpoint's ``state_dict`` (the model's under ``current_model_state``).  Gathered onto global rank 0 as
        the model is (collective over its layer chain; every rank saves, rank 0 writes).  A copy kept on the host
        (``StochasticWeightAveraging``'s default) travels through the training device and stays on the host."""
        sharded = self._sharded()
        if sharded is not None and self._writes_checkpoint(sharded):
            put_whole_averages(checkpoint, self._averages,
                               lambda copy: full_model_state_dict(copy, dst=0, device=self.root_device))
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state as the serial model's optimizer would write it (state and param groups by serial
        parameter index), gathered onto global rank 0 (checkpoint.py)."""
        sharded = self._sharded()
        if sharded is None or not self._writes_checkpoint(sharded):
            return super().optimizer_state(optimizer)
        assert self.lightning_module is not None
        return full_optimizer_state(optimizer, self.lightning_module, dst=0)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each rank takes the entries of the parameters it holds from the full (serial-layout) optimizer state,
        whatever ``layer_parallel_size`` wrote it (1 and plain one-process checkpoints included)."""
        states = list(checkpoint["optimizer_states"])
        sharded = self._sharded()
        size = sharded.chain.size if sharded is not None else 1
        for i, state in enumerate(states):
            if isinstance(state, dict) and LAYER_SHARDS in state:  # the per-layer-rank format of earlier versions
                saved = state.get("layer_parallel_size", 1)
                if saved != size:
                    raise ValueError(
                        f"the checkpoint's optimizer state is in the per-layer-rank format of earlier versions, saved "
                        f"with layer_parallel_size={saved}; this run has {size}. Resume with "
                        f"layer_parallel_size={saved} "
                        "once and save a checkpoint (it is written in the full format, which resumes with any "
                        "layer_parallel_size), or load only the model weights (saved in full, they load anywhere)"
                    )
                states[i] = state[LAYER_SHARDS][sharded.chain.index] if sharded is not None else state
            elif sharded is not None:
                assert self.lightning_module is not None
                states[i] = local_optimizer_state(state, self.optimizers[i], self.lightning_module)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

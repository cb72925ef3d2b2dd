"""Lightning adapter: ``Trainer(strategy="spatial")`` / ``SpatialParallelStrategy(spatial_parts=(ph, pw))``, or
``(pd, ph, pw)`` for volumes and ``(pl,)`` for signals.

Hybrid sample x spatial parallelism (Dryden et al., section III-A; in 3-D per section I): the world is split into
sample groups of ``prod(spatial_parts)`` contiguous ranks; each group trains on its own samples (sharded by the
sampler over sample groups only), and inside a group rank ``k`` holds the tile ``k`` unravelled row-major over
``spatial_parts`` of every sample (for images ``(k // pw, k % pw)``).  The strategy

* checks the world size (= sample groups x prod(spatial_parts)) and builds the groups at setup,
* tells the data module which tile to read (``datamodule.set_spatial_tile(index, parts)``) before the
  dataloaders exist, so no rank materialises a whole sample; data modules without that hook get their input cut
  to the tile on the host (with a warning).  What is split is decided by the data, never by a tensor's size:
  the batch entries the data module names in ``spatial_tiles``, else the model's input (the first
  ``N x C x spatial...`` tensor with as many spatial dimensions as ``spatial_parts`` has entries); every other
  tensor stays whole and is cut where it meets a split activation (the op dispatch),
* replaces no layer: every op on a split activation goes through the op dispatch (:mod:`dispatch`) to its tile
  kernel (:mod:`kernels`); the partition is validated at setup when the input shape is known (``input_shape=`` or
  the data module's ``input_shape``, :mod:`split_check`),
* sums tile gradients over the spatial group and averages over sample groups (:func:`gradients.reduce_model_gradients`)
  once per optimizer step (after gradient accumulation),
* offers ``global_pixel_count(target)`` so a segmentation loss ``sum(per-pixel) / total pixels`` equals the
  whole-sample loss (a split target counts its global extent, a whole one itself), and ``reduce`` for logged
  values.

The core pieces live in plain torch modules next to this one; this file only translates Lightning hooks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_hpc._compat import outermost_compiled_modules
from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.distributed.failure import RunFailures
from lightning_hpc.distributed.partitioned import follow_split
from lightning_hpc.distributed.sigterm import sigterm_without_collective
from lightning_hpc.distributed.start_equal import (
    generator_states,
    module_state_tensors,
    set_generator_states,
    start_equal,
    start_equal_generators,
)
from lightning_hpc.protocols import StrategyContract
from lightning_hpc.spatial.compile import SplitCompiledForward
from lightning_hpc.spatial.dispatch import ParameterUseCheck, SpatialTensor, split_tensor
from lightning_hpc.spatial.dispatch.checkpoint import refuse_reentrant
from lightning_hpc.spatial.dispatch.kfac_contract import TiledLayerRegistry
from lightning_hpc.spatial.dispatch.parameter_check import ParameterNames
from lightning_hpc.spatial.dispatch.split_check import ShapeTraceError, check_split
from lightning_hpc.spatial.dispatch.state import ModuleTrace
from lightning_hpc.spatial.dispatch.tensor import TILE_MARK
from lightning_hpc.spatial.kernels.plan import dim_names
from lightning_hpc.spatial.layout.gradients import reduce_model_gradients
from lightning_hpc.spatial.layout.halo_exchange import PartitionError
from lightning_hpc.spatial.layout.policy import DispatchPolicy
from lightning_hpc.spatial.layout.tiling import (
    HybridLayout,
    create_hybrid_layout,
    parse_parts,
    parts_text,
    tile_slices,
)
from lightning_hpc.spatial.lightning import metrics

__all__ = ["SpatialParallelStrategy"]

log = logging.getLogger(__name__)


def _layout_name(k: int) -> str:
    """``N x C x H x W`` for images, ``N x C x D x H x W`` volumes, ``N x C x L`` signals."""
    return "N x C x " + {1: "L", 2: "H x W", 3: "D x H x W"}[k]


class SpatialParallelStrategy(StrategyContract, DDPStrategy):
    """Hybrid sample x spatial data parallelism.

    Args:
        spatial_parts: tiles per sample along each spatial dimension: ``(ph, pw)`` for ``N x C x H x W`` images,
            ``(pd, ph, pw)`` for ``N x C x D x H x W`` volumes, ``(pl,)`` for ``N x C x L`` signals (any entry may be
            1); ``"auto"`` asks the performance-model planner (:func:`lightning_hpc.spatial.planner.plan_for_model`,
            images); ``None`` splits H of images over all ranks.
        overlap: let the halo travel while the tile's convolution runs (section IV-A): on the in-place tile
            path (tiles aligned to the stride, e.g. even extents) the tile's own convolution runs before the halo
            is awaited; the box path copies the tile into its box while the halo travels in either setting.
            Default off; turn it on where halo messages are slow relative to compute.
        batchnorm: ``"aggregated"``, the only value: batch norm on a split activation takes its statistics over
            the whole sample, as one process does (tile-local statistics would train differently and are not
            offered).
        input_shape: (C, H, W) of one sample, to validate the partition at setup (else taken from the data
            module's ``input_shape`` attribute when it has one, else checked at the first forward).
        timeout: collective timeout (no hangs).
        on_unsupported: what an op on a split activation without a tiled form does: ``"gather"`` (default; the
            whole activation is gathered and the op computed exactly, with a one-time warning naming the op, the
            module and the bytes) or ``"error"`` (refused before the first optimizer step).
        check_parameter_use: when the parameters used on replicated values get their share of the gradient (a
            parameter also used on split activations is summed over the spatial group, so each replicated use
            gets ``1/P`` of its gradient: ``lightning_hpc.spatial.dispatch.parameter_check``): ``"every_step"``
            (default: also a forward that takes other branches later, e.g. by a data-dependent condition; one
            more Python call per torch op of the training step) or ``"first_step"`` (only the first step, unless
            it already used a parameter both ways, then every step; a later branch that starts such a use would
            train silently differently).
        Remaining arguments go to :class:`lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "spatial"
    #: the layers are prepared in ``setup`` (after the callbacks' ``setup``): SyncBatchNorm becomes a batch norm and
    #: the convolutions and norms enter the strategy's registry of tiled layers (:attr:`kfac_tiled_layers`), so
    #: callbacks that hook layers (K-FAC) must attach in ``on_fit_start`` (the K-FAC callback's contract)
    replaces_layers_in_setup = True

    def __init__(
        self,
        spatial_parts: Sequence[int] | str | None = None,
        overlap: bool = False,
        batchnorm: str = "aggregated",
        input_shape: Sequence[int] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        on_unsupported: str = "gather",
        check_parameter_use: str = "every_step",
        **kwargs: Any,
    ) -> None:
        destroy_process_group_at_exit()  # gloo's async work must not outlive the interpreter
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
            **kwargs,
        )
        if isinstance(spatial_parts, str):
            if spatial_parts != "auto":
                raise ValueError(
                    f"spatial_parts={spatial_parts!r}: use the parts per spatial dimension, e.g. (2, 1) or (2, 2, 1), "
                    f"'auto' or None")
            self._parts_setting: tuple[int, ...] | str | None = "auto"
        else:
            self._parts_setting = None if spatial_parts is None else parse_parts(spatial_parts)
        if batchnorm != "aggregated":
            raise ValueError(
                f"batchnorm={batchnorm!r}: under the spatial strategy batch norm on a split activation always takes "
                f"its statistics over the whole sample (equal to one process); tile-local statistics would train "
                f"differently. Use batchnorm='aggregated' (the default)"
            )
        if on_unsupported not in ("gather", "error"):
            raise ValueError(f"on_unsupported={on_unsupported!r}: choose 'gather' or 'error'")
        self.on_unsupported = on_unsupported
        if check_parameter_use not in ("first_step", "every_step"):
            raise ValueError(f"check_parameter_use={check_parameter_use!r}: choose 'first_step' or 'every_step'")
        self.check_parameter_use = check_parameter_use
        self._hooks: list[Any] = []
        #: the running modules of this strategy's runs (names in the dispatch's messages), on its grid
        self._modules = ModuleTrace()
        self._tiled_layers: TiledLayerRegistry | None = None
        self._params_checked = False
        self._params_shared = False  # a tile parameter had a replicated use (parameter_check): checked every step
        self.overlap = bool(overlap)
        self.batchnorm = batchnorm
        self.input_shape = tuple(int(v) for v in input_shape) if input_shape is not None else None
        self.layout: HybridLayout | None = None
        self.plan: Any = None
        self._prepared = False
        self._slice_batches = False
        self._warned_nothing_split = False
        self._failures = RunFailures("spatial")  # a peer's failure message reaches this rank

    # -- layout ------------------------------------------------------------------------------------------------
    @property
    def spatial_parts(self) -> tuple[int, ...]:
        if self.layout is None:
            raise RuntimeError("spatial_parts is known after setup_environment()")
        return self.layout.grid.parts

    @property
    def data_parallel_size(self) -> int:
        """Number of sample groups (used for learning-rate scaling: the batch is split over sample groups only)."""
        return self.layout.num_sample_groups if self.layout is not None else self.world_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # all ranks of a spatial group must see the same samples
        if self.layout is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.layout.num_sample_groups, "rank": self.layout.sample_index}

    def _input_shape(self) -> tuple[int, ...] | None:
        if self.input_shape is not None:
            return self.input_shape
        dm = self._datamodule()
        shape = getattr(dm, "input_shape", None) if dm is not None else None
        return tuple(int(v) for v in shape) if shape is not None else None

    def _datamodule(self) -> Any:
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None) if lm is not None else None
        return getattr(trainer, "datamodule", None) if trainer is not None else None

    def _resolve_parts(self) -> tuple[int, ...]:
        world = self.world_size
        if self._parts_setting is None:
            return (world, 1)
        if self._parts_setting == "auto":
            from lightning_hpc.spatial.planner import plan_for_model

            shape = self._input_shape()
            if shape is None:
                raise ValueError(
                    "spatial_parts='auto' needs the input shape: pass input_shape=(C, H, W) to the strategy"
                )
            assert self.lightning_module is not None  # connected before setup_environment
            model = getattr(self.lightning_module, "model", self.lightning_module)
            # The strategy runs one split for the whole network, so ask the planner for the best uniform one.
            self.plan = plan_for_model(model, shape, world, uniform=True)
            return parse_parts(self.plan.spatial_parts, setting="planner spatial_parts")
        return self._parts_setting  # type: ignore[return-value]

    @override
    def setup_distributed(self) -> None:
        # DDPStrategy.setup_distributed reseeds every generator with the seed of the user's seed_everything
        # (Lightning's reset_seed). The user seeded once and then built the model, which drew its initial weights
        # from that stream: reseeded, the ranks drew every dropout mask from the state before the weights, one
        # process from the state after them. The generators stay where the user's script left them.
        states = generator_states()
        super().setup_distributed()
        set_generator_states(states)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # process group
        parts = self._resolve_parts()
        if self.world_size % math.prod(parts) != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by spatial_parts={parts_text(parts)}="
                f"{math.prod(parts)} (ranks per sample); use devices x num_nodes = sample groups x "
                f"prod(spatial_parts), or change spatial_parts"
            )
        self.layout = create_hybrid_layout(parts, timeout=self._timeout, device_type=self.root_device.type)
        # this run's settings travel with its grid (every split tensor holds it), not with the process
        self.layout.grid.policy = DispatchPolicy(overlap=self.overlap, on_unsupported=self.on_unsupported)
        self._device_mesh = self.layout.mesh
        how = {"auto": " (planned)", None: " (the default: H split over every rank)"}
        chosen = how.get(self._parts_setting, "") if not isinstance(self._parts_setting, tuple) else ""
        rank_zero_info(
            f"SpatialParallelStrategy: {parts_text(parts)} ({' x '.join(dim_names(len(parts)))}) tiles per sample, "
            f"{self.layout.num_sample_groups} sample group(s) of {self.layout.grid.size} rank(s){chosen}")
        if self.layout.grid.size > 1:
            # from here on every torchmetrics object made (in the module's or a callback's setup, lazily at the
            # first batch, ...) counts each pixel and sample once, wherever it is kept (spatial/lightning/metrics.py)
            metrics.activate(self.layout)
            refuse_reentrant(True)  # until teardown: a reentrant checkpoint of a split activation is refused by name
        self._failures.start()
        dm = self._datamodule()
        if dm is not None and hasattr(dm, "set_spatial_tile"):
            dm.set_spatial_tile(self.layout.grid.index, parts)
        elif math.prod(parts) > 1:
            self._slice_batches = True
            log.warning(
                "SpatialParallelStrategy: the data module has no set_spatial_tile(tile_index, parts); every rank loads "
                "whole samples and keeps only its tile (memory of a whole sample on the host)"
            )

    # -- model -------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        sigterm_without_collective(trainer)  # SIGTERM ends every rank promptly (no collective in its handler)
        self._compile_split()
        self._prepare_model()
        self._attach()
        super().setup(trainer)

    def _compile_split(self) -> None:
        """A ``torch.compile``'d module compiles its split step: while this strategy runs it, its forward on split
        inputs is one graph of tile operations compiled with its own backend (:mod:`lightning_hpc.spatial.compile`);
        one that cannot be (named once, in a warning) runs eagerly through the op dispatch, exactly.  After the
        stage it calls its own compiled code again (:meth:`teardown`)."""
        module = self.lightning_module
        assert self.layout is not None and module is not None
        if self.layout.grid.size == 1 or self.world_size == 1:
            return
        for name, compiled in outermost_compiled_modules(module):
            compiled.forward = SplitCompiledForward(compiled, name=f"{type(module).__name__}.{name}")

    def _prepare_model(self) -> None:
        if self._prepared:
            return
        assert self.layout is not None and self.lightning_module is not None
        module = self.lightning_module
        target = getattr(module, "model", None)
        target = target if isinstance(target, torch.nn.Module) else module
        shape = self._input_shape()
        if shape is not None:
            try:
                check_split(target, shape, self.layout.grid.parts)
            except (PartitionError, ValueError):
                raise
            # the shape trace is an early check only (the model is left as it was); the first step checks every op
            except ShapeTraceError as e:
                log.warning(f"SpatialParallelStrategy: {e}; the split is checked at the first training step instead")
            except Exception as e:  # noqa: BLE001
                log.warning(
                    f"SpatialParallelStrategy: the setup-time split check failed ({type(e).__name__}: "
                    f"{str(e)[:200]}); the split is checked at the first training step instead"
                )
        self._sync_batchnorm_to_batchnorm(module)
        # no layer is replaced: every op on a split activation is dispatched to its tile kernel
        # (lightning_hpc.spatial.dispatch)
        self.layout.grid.tile_params.clear()  # parameters met on tiles are recorded afresh for this module
        self._count_metrics()
        self._prepared = True

    def _attach(self) -> None:
        """This run's state, on objects of this run (every fit, validate, test or predict; :meth:`teardown` undoes
        it): the grid of this setup's layout carries this strategy's registry of the layers on tiles, which K-FAC
        gets from :attr:`kfac_tiled_layers` (one registry for the strategy's life: a K-FAC preconditioner built at
        an earlier fit keeps reading it), and the running modules' names are tracked for messages by hooks this
        strategy removes at teardown.  Nothing is written onto the user's modules."""
        assert self.layout is not None and self.lightning_module is not None
        module, grid = self.lightning_module, self.layout.grid
        if self._tiled_layers is None:
            self._tiled_layers = TiledLayerRegistry(grid.size)
        self._tiled_layers.partition_size = grid.size
        grid.tiled_layers = self._tiled_layers.declare(module)
        self._remove_hooks()
        grid.modules = self._modules
        self._hooks = self._modules.hooks(module)

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._modules.clear()

    @property
    def kfac_tiled_layers(self) -> TiledLayerRegistry | None:
        """The convolutions this strategy runs on tiles and the normalisation layers whose statistics span them
        (:class:`~lightning_hpc.spatial.dispatch.kfac_contract.TiledLayerRegistry`), which the K-FAC callback hands
        to its preconditioner; ``None`` before the first setup."""
        return self._tiled_layers

    def _sync_batchnorm_to_batchnorm(self, module: torch.nn.Module) -> None:
        """``nn.SyncBatchNorm`` takes its statistics over every rank's samples (and runs on GPUs only).  With one
        sample group those are the whole samples of the spatial group, which the aggregated batch norm computes on
        any device (section III-B): such layers become batch norms, dispatched like any other.  With several sample
        groups the statistics would also span the other groups' samples, which nothing here computes: refused."""
        assert self.layout is not None
        for name, m in module.named_modules():
            if not isinstance(m, torch.nn.SyncBatchNorm):
                continue
            if self.layout.num_sample_groups > 1:
                raise ValueError(
                    f"SpatialParallelStrategy: layer '{name}' is nn.SyncBatchNorm, whose statistics span the samples "
                    f"of all {self.layout.num_sample_groups} sample groups; the spatial strategy takes batch-norm "
                    f"statistics over the whole samples of each sample group. Use nn.BatchNorm2d (or "
                    f"spatial_parts covering every rank, one sample group, where SyncBatchNorm is computed exactly)"
                )
            # same parameters and buffers; SyncBatchNorm adds a process group only
            m.__class__ = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d,  # type: ignore[assignment]
                           3: torch.nn.BatchNorm3d}[self.layout.grid.ndim]

    def _count_metrics(self) -> None:
        """Metrics that exist already (held by the LightningModule or a Trainer callback) count each pixel and
        sample once (:mod:`spatial.lightning.metrics`; metrics made later get that from torchmetrics' constructor while
        the strategy runs).  Run at setup and when each loop starts, for metrics made earlier and attached since."""
        module = self.lightning_module
        if self.layout is None or self.layout.grid.size == 1 or module is None:
            return
        metrics.count_once_per_pixel(module)
        trainer = module._trainer
        # the Trainer's callbacks are set by Lightning's callback connector (undeclared on the class)
        callbacks = trainer.callbacks if trainer is not None else []  # type: ignore[attr-defined]
        for callback in callbacks:  # metrics a callback holds
            metrics.count_once_per_pixel(callback, prefix=f"{type(callback).__name__}.")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._count_metrics()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._count_metrics()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._count_metrics()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._count_metrics()

    @override
    def teardown(self) -> None:
        self._failures.stop()
        self._remove_hooks()  # the user's modules leave the run as they came
        if self.lightning_module is not None:
            follow_split(self.lightning_module)  # a compiled module calls its compiled code again after the run
        if self.layout is not None:
            metrics.deactivate(self.layout)  # the class-level metric hooks end with the run
            refuse_reentrant(False)
        super().teardown()

    @override
    def configure_ddp(self) -> None:
        # no DDP wrapper: gradients need a sum over tiles and a mean over samples (reduce_gradients); start equal
        assert self.model is not None
        start_equal(module_state_tensors(self.model))
        # every rank draws the whole activation's random values and keeps its tile's (dispatch/creation.py): the
        # tiles of one mask must come from one stream, rank 0's (one process's where the user seeded before building
        # the model), also where the ranks were not seeded alike
        start_equal_generators(self.root_device)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            out = closure()
            assert self.lightning_module is not None
            if self.lightning_module.automatic_optimization:  # manual: already global after each backward
                self.reduce_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._modules.clear()
        checked = self._params_checked and self.check_parameter_use == "first_step" and not self._params_shared
        if checked or self.layout is None or self.layout.grid.size == 1:
            return super().training_step(*args, **kwargs)
        # every step (or the first): the parameters used on replicated values get their share of the gradient (a
        # parameter also used on tiles is summed over the group: parameter_check), and what a compiled step's
        # trace used on both is refused before the update
        assert self.lightning_module is not None
        names = ParameterNames(self.lightning_module)  # listed only if a message needs them
        check = ParameterUseCheck(self.layout.grid.tile_params, names, self._modules, self.layout.grid.size)
        with check:
            out = super().training_step(*args, **kwargs)
        check.raise_if_mixed(names)
        self._params_checked = True
        # a parameter used on tiles and on replicated values needs its share at every step, also under "first_step"
        self._params_shared = self._params_shared or check.shares_tile_parameters()
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Under manual optimization gradients are global when ``manual_backward`` returns, as under DDP, so
        ``self.clip_gradients`` or any read of ``.grad`` before ``step()`` sees one process's gradient.  Only the
        gradient of this backward pass is reduced (the reduction sums tiles: reducing an already global gradient
        again would count it once per tile); automatic optimization reduces once per optimizer step."""
        module = self.lightning_module
        if module is None or module.automatic_optimization or self.layout is None or self.world_size == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        params = [p for p in module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.reduce_gradients()
        for p, g in zip(params, earlier):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return loss

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failure on one rank ends every rank promptly with its message (:class:`RunFailures`)."""
        super().on_exception(exception)
        self._failures.share(exception)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._modules.clear()
        return super().validation_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions leave the strategy whole: every split tensor ``predict_step`` returns is gathered here,
        while every rank of the spatial group is still in the loop.  A split tensor handed to user code after
        ``trainer.predict`` would gather on first use, and a rank 0 using it alone would wait for its peers."""
        self._modules.clear()
        out = super().predict_step(*args, **kwargs)
        return apply_to_collection(out, SpatialTensor, lambda t: t.full().detach())

    def reduce_gradients(self) -> None:
        """Parameters used directly on tiles hold partial sums over the tiles (summed over the spatial group);
        every other parameter holds its complete gradient (averaged), as recorded by the op dispatch."""
        assert self.layout is not None and self.lightning_module is not None
        reduce_model_gradients(self.lightning_module, self.layout.num_sample_groups, self.layout.grid.tile_params)

    # -- data --------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.layout is None or self.layout.grid.size == 1:
            return super().batch_to_device(batch, device, dataloader_idx)
        paths = self._split_paths(batch)
        whole: dict[tuple, tuple[int, ...]] = {}
        if self._slice_batches:  # cut on the host: the global extent is the whole tensor's
            grid = self.layout.grid
            k = grid.ndim
            for path in paths:
                t = _get(batch, path)
                whole[path] = tuple(int(n) for n in t.shape[-k:])
                cut = (Ellipsis,) + tile_slices(whole[path], grid.parts, grid.index)
                batch = _set(batch, path, t[cut].contiguous())
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self._split(batch, paths, whole)

    def _split_paths(self, batch: Any) -> list[tuple]:
        """Where in ``batch`` the tensors to split are: what the data module declares in ``spatial_tiles``, else
        the model's input, the first ``N x C x spatial...`` tensor (as many spatial dimensions as the grid).  Every
        other tensor stays whole (a label at another resolution, a per-row label, a mask of the whole sample): the
        op dispatch cuts it exactly where it meets a split activation, whose layout it knows, so no tensor is taken
        for a tile because of its size."""
        dm = self._datamodule()
        declared = getattr(dm, "spatial_tiles", None) if dm is not None else None
        if declared is not None:
            paths = [tuple(k) if isinstance(k, tuple) else (k,) for k in declared]
            if isinstance(batch, Tensor):
                paths = [()] if paths else []
            for path in paths:
                try:
                    t = _get(batch, path)
                except (KeyError, IndexError, TypeError):
                    t = None
                if not isinstance(t, Tensor) or t.dim() < 2:
                    raise ValueError(
                        f"SpatialParallelStrategy: the data module's spatial_tiles names batch entry {path!r}, which "
                        f"is not a tensor of at least 2 dimensions ({type(t).__name__}); list the positions (tuple "
                        f"batches) or keys (dict batches) of the tensors it reads as tiles"
                    )
            return paths
        k = self._spatial_ndim()
        images = [(path, t) for path, t in _paths(batch) if t.dim() == 2 + k and not isinstance(t, SpatialTensor)]
        if not images:
            if not self._warned_nothing_split and not any(isinstance(t, SpatialTensor) for _, t in _paths(batch)):
                self._warned_nothing_split = True
                assert self.layout is not None
                log.warning(
                    f"SpatialParallelStrategy: the batch holds no {_layout_name(k)} tensor, so nothing is split: every "
                    f"rank of a spatial group ({self.layout.grid.size} ranks) computes the same thing on the same "
                    "samples (correct, but no faster than one of them). Use strategy='ddp' for such data, or give the "
                    f"batch its samples as {_layout_name(k)} tensors (or name them in the data module's spatial_tiles)"
                )
            return []
        return [images[0][0]]

    def _spatial_ndim(self) -> int:
        """How many spatial dimensions a sample has: one per entry of ``spatial_parts`` (images until known)."""
        if self.layout is not None:
            return self.layout.grid.ndim
        return len(self._parts_setting) if isinstance(self._parts_setting, tuple) else 2

    def _split(self, batch: Any, paths: list[tuple], whole: dict[tuple, tuple[int, ...]]) -> Any:
        """The tensors at ``paths`` as :class:`SpatialTensor` objects over their last ``grid.ndim`` dimensions.  Cut
        on the host, their global extent is known (``whole``); read as tiles by the data module, it is summed over the
        group (one all-reduce for all of them).  A data module that reads tiles but declares no ``spatial_tiles``
        gets only its input split; another batch tensor as large as its tile could be a tile or a whole tensor at
        a lower resolution, so that case is refused (decided over the group: one rank's tile may differ)."""
        assert self.layout is not None
        grid = self.layout.grid
        tiles = [_get(batch, path) for path in paths]
        if whole:
            extents = [whole[path] for path in paths]
        else:
            k, index = grid.ndim, grid.index
            undeclared = self._slice_batches is False and getattr(self._datamodule(), "spatial_tiles", None) is None
            ambiguous = [
                path for path, t in _paths(batch)
                if undeclared and tiles and path not in paths and t.dim() >= k
                and tuple(t.shape[-k:]) == tuple(tiles[0].shape[-k:])
            ]
            # a tile counts its extent along dimension d when it lies on the line of tiles through the origin along d
            sizes = [int(t.shape[t.dim() - k + d]) if all(i == 0 for e, i in enumerate(index) if e != d) else 0
                     for t in tiles for d in range(k)]
            device = tiles[0].device if tiles else None
            counts = torch.tensor([*sizes, len(ambiguous)], dtype=torch.int64, device=device)
            if grid.group is not None and tiles:
                dist.all_reduce(counts, group=grid.group)
            if int(counts[-1]):
                where = f" ({ambiguous[0]!r} here)" if ambiguous else " (on another rank of the spatial group)"
                raise ValueError(
                    "SpatialParallelStrategy: the data module reads tiles (set_spatial_tile) and the batch holds a "
                    f"tensor besides the input whose spatial dimensions are as large as the input's tile{where}: "
                    "a tile, or a whole tensor at a lower resolution? Declare the batch entries the data module reads "
                    "as tiles, e.g. `spatial_tiles = (0, 1)` on the data module for an (image, mask) batch whose mask "
                    "it cuts too, or `spatial_tiles = (0,)` when every other tensor is whole"
                )
            extents = [tuple(int(v) for v in counts[k * m : k * (m + 1)]) for m in range(len(tiles))]
        for path, t, extent in zip(paths, tiles, extents):
            if not isinstance(t, SpatialTensor):
                batch = _set(batch, path, split_tensor(t, grid, (*t.shape[: t.dim() - len(extent)], *extent)))
        return batch

    def global_pixel_count(self, target: Tensor) -> int:
        """Number of target pixels of the whole samples of this sample group.  A split target and a whole one
        (every batch tensor the data does not split stays whole) count their whole extent as they are; only a
        tile cut out by hand with :func:`~lightning_hpc.spatial.dispatch.local_tile` is summed over the
        spatial group."""
        if not getattr(target, TILE_MARK, False):
            return int(target.numel())  # a SpatialTensor reports its global count; a whole tensor is whole
        n = torch.tensor([target.numel()], dtype=torch.int64, device=target.device)
        if self.layout is not None and self.layout.grid.group is not None:
            dist.all_reduce(n, group=self.layout.grid.group)
        return int(n.item())

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Mean over the mini-batch of values logged per rank.  Values computed from split activations are whole
        values (reductions over split dimensions are global), replicated over the spatial group: each spatial
        group counts once."""
        if not isinstance(tensor, Tensor) or not dist.is_initialized() or self.layout is None:
            return tensor
        mean = reduce_op in (None, "mean", "avg")
        if group is not None or not (mean or reduce_op in ("sum", dist.ReduceOp.SUM)):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        out = tensor.detach().clone().to(torch.float32 if not tensor.is_floating_point() else tensor.dtype)
        out = out / self.layout.grid.size  # every tile holds the whole value: count it once
        dist.all_reduce(out)
        if mean:
            out = out / self.layout.num_sample_groups
        return out


def _paths(batch: Any, prefix: tuple = ()) -> list[tuple[tuple, Tensor]]:
    """``(path, tensor)`` for every tensor of a batch (tuples, lists and dicts, nested), in order."""
    if isinstance(batch, Tensor):
        return [(prefix, batch)]
    items = batch.items() if isinstance(batch, dict) else enumerate(batch) if isinstance(batch, (list, tuple)) else ()
    return [found for key, value in items for found in _paths(value, (*prefix, key))]


def _get(batch: Any, path: tuple) -> Any:
    for key in path:
        batch = batch[key]
    return batch


def _set(batch: Any, path: tuple, value: Any) -> Any:
    """``batch`` with the entry at ``path`` replaced (containers rebuilt, the batch itself not changed)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(batch, dict):
        out = dict(batch)
        out[key] = _set(batch[key], rest, value)
        return type(batch)(out) if type(batch) is not dict else out
    items = list(batch)
    items[key] = _set(items[key], rest, value)
    if hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*items)
    return type(batch)(items)

"""Lightning adapter: ``Trainer(strategy="multigrid")`` / ``MultigridStrategy(...)``.

Translates Lightning hooks only; the algorithm lives in the plain-torch modules of this package.

* ranks form a data x layer mesh (``layer_parallel_size`` ranks per layer chain); the sampler shards data
  over the data dimension only (the ranks of one chain see the same batch);
* the model's residual trunk (attribute ``trunk``, default ``steps`` as in ``ODEResNet``) is replaced by a
  :class:`MultigridODEBlock` (or the partitioned-model baseline with ``mode="pm"``) holding the same modules;
* after backward, gradients are averaged over the data dimension (each layer rank owns its steps' gradients);
* the per-cycle residual norms of the forward solve (and of the previous step's adjoint solve) are logged as
  ``multigrid/forward_residual_<cycle>`` and ``multigrid/backward_residual_<cycle>``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_hpc.registry import register_strategy
from lightning_hpc.strategies.multigrid.function import MultigridODEBlock
from lightning_hpc.strategies.multigrid.options import MultigridOptions, SolveSettings
from lightning_hpc.strategies.multigrid.parallel import average_gradients, layer_data_groups
from lightning_hpc.strategies.multigrid.partition import check_layer_partition
from lightning_hpc.strategies.multigrid.pm import PartitionedODEBlock

__all__ = ["MultigridStrategy"]

MODES = ("mg", "pm", "serial")


class MultigridStrategy(DDPStrategy):
    """Layer-parallel multigrid training (Kirby et al.), optionally combined with data parallelism.

    Args:
        layer_parallel_size: ranks per layer chain (default: all ranks); the world size must be a multiple.
        cfactor, levels, relaxation: the hierarchy (see :class:`MultigridOptions`).
        forward_cycles, forward_tol, backward_cycles, backward_tol: stopping rules of the two solves.
        mode: "mg" (multigrid), "pm" (partitioned model: same partition, serial evaluation) or "serial"
            (no change to the model; data parallelism only).
        trunk: attribute path of the residual trunk inside ``lightning_module.model``.
        concurrent: batch the blocks of a relaxation in one vmapped call (False: block after block).
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
        trunk: str = "steps",
        concurrent: bool = True,
        log_residuals: bool = True,
        timeout: timedelta | None = timedelta(seconds=1800),
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layer_parallel_size is not None and layer_parallel_size < 1:
            raise ValueError(f"layer_parallel_size must be >= 1, got {layer_parallel_size}")
        super().__init__(timeout=timeout, **kwargs)
        # validated now so a bad setting fails before any process is started
        self.options = MultigridOptions(
            cfactor=cfactor,
            levels=levels,
            relaxation=relaxation,
            forward=SolveSettings(forward_cycles, forward_tol),
            backward=SolveSettings(backward_cycles, backward_tol),
            concurrent=concurrent,
        )
        self.layer_parallel_size_setting = layer_parallel_size
        self.mode, self.trunk, self.log_residuals = mode, trunk, log_residuals
        self.data_group: dist.ProcessGroup | None = None
        self.layer_group: dist.ProcessGroup | None = None
        self._data_index, self._layer_index = 0, 0
        self.block: nn.Module | None = None

    # -- sizes and sampler ---------------------------------------------------------------------------------
    @property
    def layer_parallel_size(self) -> int:
        return self.layer_parallel_size_setting or self.world_size

    @property
    def data_parallel_size(self) -> int:
        return max(self.world_size // self.layer_parallel_size, 1)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of a layer chain must see the same samples: shard over the data dimension only
        return {"num_replicas": self.data_parallel_size, "rank": self._data_index}

    # -- model setup (instead of DDP wrapping) ------------------------------------------------------------
    def _find_trunk(self) -> tuple[nn.Module, str, nn.Module]:
        module = self.lightning_module
        root = getattr(module, "model", module)
        *path, name = self.trunk.split(".")
        parent = root
        for part in path:
            parent = getattr(parent, part)
        trunk = getattr(parent, name, None)
        if trunk is None:
            raise ValueError(
                f"MultigridStrategy(trunk={self.trunk!r}): the model ({type(root).__name__}) has no attribute "
                f"{self.trunk!r}; set trunk= to the attribute holding the nn.Sequential of residual steps "
                "(ODEResNet calls it 'steps')"
            )
        return parent, name, trunk

    def _check_sizes(self) -> None:
        if self.world_size % self.layer_parallel_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by layer_parallel_size={self.layer_parallel_size}; "
                f"use a world size that is a multiple of {self.layer_parallel_size}, or change layer_parallel_size"
            )
        if self.mode == "serial" and self.layer_parallel_size != 1:
            raise ValueError(f"mode='serial' runs every layer on every rank: set layer_parallel_size=1 (got {self.layer_parallel_size})")

    def _wrap_model(self) -> None:
        if self.block is not None:
            return
        self._check_sizes()
        parent, name, trunk = self._find_trunk()
        levels = self.options.levels if self.mode == "mg" else 1
        n_steps = len(trunk) if isinstance(trunk, (nn.Sequential, nn.ModuleList)) else 0
        check_layer_partition(n_steps, self.layer_parallel_size, self.options.cfactor, levels)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            device_type = self.root_device.type
            self.data_group, self.layer_group, self._data_index, self._layer_index = layer_data_groups(self.layer_parallel_size, device_type)
            # no DDP wrapper broadcasts the initial weights: do it here so every replica starts equal
            with torch.no_grad():
                for t in self.lightning_module.state_dict().values():
                    if isinstance(t, torch.Tensor):
                        dist.broadcast(t, 0)
        layer_group = self.layer_group if self.layer_parallel_size > 1 else None
        if self.mode == "mg":
            self.block = MultigridODEBlock(trunk, self.options, group=layer_group)
        elif self.mode == "pm":
            self.block = PartitionedODEBlock(trunk, group=layer_group)
        else:
            self.block = trunk
        setattr(parent, name, self.block)

    def configure_ddp(self) -> None:
        self._wrap_model()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._wrap_model()  # also when validating / testing only (DDPStrategy skips configure_ddp then)

    # -- gradients, logging, checkpoints ----------------------------------------------------------------------
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        average_gradients(list(self.lightning_module.parameters()), self.data_group)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        previous_backward = list(getattr(self.block, "backward_history", []))
        out = super().training_step(*args, **kwargs)
        if self.log_residuals and isinstance(self.block, MultigridODEBlock):
            module = self.lightning_module
            for i, value in enumerate(self.block.forward_history):
                module.log(f"multigrid/forward_residual_{i}", value, on_step=True, on_epoch=False)
            for i, value in enumerate(previous_backward):
                module.log(f"multigrid/backward_residual_{i}", value, on_step=True, on_epoch=False)
        return out

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if isinstance(self.block, MultigridODEBlock):
            self.block.sync_parameters()  # each rank updated only its own steps
        elif isinstance(self.block, PartitionedODEBlock) and self.layer_group is not None:
            _sync_partitioned(self.block)
        return super().lightning_module_state_dict()


def _sync_partitioned(block: PartitionedODEBlock) -> None:
    ranks = dist.get_process_group_ranks(block.group)
    with torch.no_grad():
        for i, step in enumerate(block):
            owner = ranks[block.partition.owner(i)]
            for t in list(step.parameters()) + list(step.buffers()):
                dist.broadcast(t.data, owner, group=block.group)


register_strategy("multigrid", MultigridStrategy, "Layer-parallel multigrid (FAS/MGRIT) training of deep ODE-ResNets")

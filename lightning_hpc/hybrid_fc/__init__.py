"""Hybrid data/model parallelism: data-parallel convolutional trunk, model-parallel fully-connected head.

Krizhevsky, "One weird trick for parallelizing convolutional neural networks" (2014), section 4: schemes a, b, c,
weight synchronisation (4.1) and the variable batch size (4.2).  Plain PyTorch + torch.distributed; the Lightning
adapter is ``lightning_hpc.hybrid_fc.strategy.HybridParallelStrategy``.
"""

from lightning_hpc.hybrid_fc.checkpoint import (
    full_optimizer_state,
    full_state_dict,
    shard_optimizer_state,
)
from lightning_hpc.hybrid_fc.collectives import ByteCounter, HeadComm
from lightning_hpc.hybrid_fc.discovery import HeadNotFoundError, HeadSpec, find_head
from lightning_hpc.hybrid_fc.head import FC_UPDATES, HybridHead
from lightning_hpc.hybrid_fc.layout import layout_cost, plan_layout
from lightning_hpc.hybrid_fc.optim import HeadOptimizer
from lightning_hpc.hybrid_fc.parallel import (
    average_trunk_gradients,
    find_hybrid_head,
    find_hybrid_heads,
    has_meta_head,
    head_parameters,
    linear_layers_on_meta,
    materialize_meta,
    parallelize_head,
    trunk_parameters,
    unparallelize_head,
)
from lightning_hpc.hybrid_fc.schemes import SCHEMES
from lightning_hpc.hybrid_fc.sharded_linear import ShardedLinear

__all__ = [
    "ByteCounter",
    "FC_UPDATES",
    "HeadComm",
    "HeadNotFoundError",
    "HeadOptimizer",
    "HeadSpec",
    "HybridHead",
    "SCHEMES",
    "ShardedLinear",
    "average_trunk_gradients",
    "find_head",
    "find_hybrid_head",
    "find_hybrid_heads",
    "full_optimizer_state",
    "full_state_dict",
    "has_meta_head",
    "head_parameters",
    "linear_layers_on_meta",
    "materialize_meta",
    "layout_cost",
    "parallelize_head",
    "plan_layout",
    "shard_optimizer_state",
    "trunk_parameters",
    "unparallelize_head",
]

"""One fully-connected layer of which this rank owns 1/K (column- or row-parallel, see ``layout.py``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from lightning_hpc._compat import weight_norm
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.distributed.partitioned import as_block_parameter, local_block
from lightning_hpc.distributed.state import gather_keyed_tensors
from lightning_hpc.hybrid_fc.collectives import HeadComm
from lightning_hpc.hybrid_fc.functions import round_to, scale_grad
from lightning_hpc.hybrid_fc.parametrized import G, V, parametrizations, weight_norm_dim

__all__ = ["ShardedLinear", "gather_shard_tensors"]


class ShardedLinear(nn.Module):
    """Shard of ``nn.Linear(in_features, out_features)`` owned by rank ``rank`` of ``k``.

    ``col``: ``weight = W[o0:o1]`` and ``bias = b[o0:o1]`` (block of output neurons).
    ``row``: ``weight = W[:, i0:i1]`` (block of input neurons) and ``bias = b[o0:o1]``; the bias block is added to
    the matching columns of the partial sum so the reduce-scatter that follows yields ``x W^T + b`` exactly.
    Blocks follow :func:`lightning_hpc.distributed.partition.block_bounds` (uneven sizes allowed).

    ``state_dict`` holds the shards under the names of ``nn.Linear``; ``load_state_dict`` accepts either a shard
    or the full tensor (which it slices), so a full checkpoint loads on any K.

    A ``linear`` whose weight is ``weight_norm``'ed (``col`` only, see ``parametrized.py``) gives the shard the same
    parametrization, with this rank's rows of its originals ``g`` and ``v`` (:data:`param_names`): the shard's
    ``state_dict`` keys, optimizer and gradients are the user's layer's, and its weight is ``g v / ||v||`` row by row.

    If ``linear`` lives on the meta device (built under ``torch.device("meta")``, ``Trainer.init_module`` or
    ``LightningModule.configure_model`` with :class:`HybridParallelStrategy`), only this rank's shard is allocated,
    on ``device``, and initialised by ``init(self)`` or, by default, :meth:`reset_parameters` (the distribution of
    ``nn.Linear``'s own initialisation, bounds from the *full* fan-in).  The full weight never exists on any rank.
    """

    def __init__(
        self,
        linear: nn.Linear,
        layout: str,
        rank: int,
        k: int,
        device: torch.device | str | None = None,
        init: Callable[[ShardedLinear], None] | None = None,
    ) -> None:
        super().__init__()
        if layout not in ("col", "row"):
            raise ValueError(f"layout must be 'col' or 'row', got {layout!r}")
        self.layout, self.rank, self.k = layout, rank, k
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_bounds = block_bounds(self.out_features, k)
        self.in_bounds = block_bounds(self.in_features, k)
        #: the scale of the last forward's parameter gradients (1/K for the per-step update; see ``forward``)
        self.kfac_grad_scale = 1.0 / k
        #: positions per sample of the rows of the current forward (a (batch, tokens, features) input run row by
        #: row); K-FAC's sharded handler forms its factors per sample and refuses more than one
        self.kfac_positions = 1
        #: the dtype autocast multiplied this layer in during its last training forward (None: none), whose
        #: rounding of the weight and bias gradients :class:`~lightning_hpc.hybrid_fc.autocast_grads.AutocastGradients`
        #: applies
        self.autocast_dtype: torch.dtype | None = None
        w = linear.weight.detach()
        if w.is_meta:
            dev = torch.device("cpu") if device is None else torch.device(device)
            # Allocate the shard only: the meta tensors carry shape and dtype, no storage.
            self.weight = nn.Parameter(torch.empty(self._slice_weight(w).shape, dtype=w.dtype, device=dev))
            self.bias = (
                None
                if linear.bias is None
                else nn.Parameter(torch.empty(self._slice_bias(linear.bias).shape, dtype=w.dtype, device=dev))
            )
            (init or ShardedLinear.reset_parameters)(self)
        else:
            self.weight = nn.Parameter(self._slice_weight(w).clone())
            self.bias = None if linear.bias is None else nn.Parameter(self._slice_bias(linear.bias.detach()).clone())
        self.weight_norm_dim = weight_norm_dim(linear)
        if self.weight_norm_dim is not None:
            self._weight_normalize(linear, w.is_meta)

    @torch.no_grad()
    def _weight_normalize(self, linear: nn.Linear, meta: bool) -> None:
        """The user's weight_norm on the shard.  Registering it computes ``g``, ``v`` from the shard's weight (a
        meta-built layer's initial values, as weight_norm does for a fresh layer); a materialised layer's own
        originals then replace them, since ``v`` trains at its own scale (its gradient depends on ``||v||``)."""
        if self.layout != "col":
            raise ValueError(f"a weight_norm'ed head layer is split by output neurons ('col'), got {self.layout!r}")
        parametrize.register_parametrization(self, "weight", copy.deepcopy(parametrizations(linear)["weight"][0]))
        if not meta:
            for name in (G, V):
                self.get_parameter(name).copy_(self._slice_weight(linear.get_parameter(name).detach()))

    @property
    def param_names(self) -> list[str]:
        """The shard's parameters by their names in the user's layer (``state_dict`` keys), weight first."""
        weight = [G, V] if self.weight_norm_dim is not None else ["weight"]
        return weight + (["bias"] if self.bias is not None else [])

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear.reset_parameters`` on the shard: weight ``kaiming_uniform_(a=sqrt(5))`` and bias
        ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` are both ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` with the fan-in of the
        *full* layer (``in_features``), not of a row shard's ``in_features / K`` columns, so every entry has the
        distribution it has in the serial layer (the shards are independent draws, not the serial draw)."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    def partition_parameters(self, group: Any) -> None:
        """Make ``weight`` and ``bias`` blocks of the whole layer's tensors over the head's ``group``
        (:class:`lightning_hpc.distributed.partitioned.BlockTensor`): user code reducing over the model's
        parameters or their gradients (a logged gradient norm, an L2 penalty, ``clip_grad_norm_``) sees the whole
        layer's values, as on one process.  Call before any optimizer holds the parameters."""
        # col: the weight's rows (output neurons) are split; row: its columns; the bias is split by output neurons
        if self.weight_norm_dim is not None:  # g and v: split by rows, as the weight they make (col only)
            chain = parametrizations(self)["weight"]
            for name in ("original0", "original1"):
                setattr(chain, name, as_block_parameter(chain.get_parameter(name), group, dim=0))
        else:
            self.weight = as_block_parameter(self.weight, group, dim=0 if self.layout == "col" else 1)
        if self.bias is not None:
            self.bias = as_block_parameter(self.bias, group, dim=0)

    # -- what K-FAC asks of a sharded layer (lightning_hpc.protocols.ShardedFullyConnected) ----------------
    def kfac_block(self, side: str) -> tuple[int, int]:
        """[start, stop) of this rank's block of the ``"in"`` or ``"out"`` features."""
        return (self.in_bounds if side == "in" else self.out_bounds)[self.rank]

    def kfac_gather(self, t: torch.Tensor, side: str, dim: int) -> torch.Tensor:
        """Every rank's block of the ``side`` features of ``t`` (this rank's along ``dim``), concatenated along
        ``dim``: the whole layer's.  Collective over the head's ranks."""
        if self.k == 1:
            return t
        sizes = self.in_sizes if side == "in" else self.out_sizes
        # the head's group, which the parameters are blocks over (partition_parameters; None: the world)
        partition = getattr(self.get_parameter(self.param_names[0]), "_partition", None)
        group = partition.group if partition is not None else None
        return HeadComm(group).all_gather(t.contiguous(), sizes, dim=dim)

    # -- shard geometry ------------------------------------------------------------------------------------
    @property
    def out_sizes(self) -> list[int]:
        return [b - a for a, b in self.out_bounds]

    @property
    def in_sizes(self) -> list[int]:
        return [b - a for a, b in self.in_bounds]

    @property
    def weight_dim(self) -> int:
        """Dimension of the full weight along which it is sharded."""
        return 0 if self.layout == "col" else 1

    def _slice_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.layout == "col":
            a, b = self.out_bounds[self.rank]
            return w[a:b]
        a, b = self.in_bounds[self.rank]
        return w[:, a:b]

    def _slice_bias(self, bias: torch.Tensor) -> torch.Tensor:
        a, b = self.out_bounds[self.rank]
        return bias[a:b]

    def full_shape(self, name: str) -> tuple[int, ...]:
        shapes = {"weight": (self.out_features, self.in_features), V: (self.out_features, self.in_features),
                  G: (self.out_features, 1), "bias": (self.out_features,)}
        return shapes[name]

    def shard_sizes(self, name: str) -> tuple[list[int], int]:
        """(block sizes over ranks, dimension) of parameter ``name`` in the full tensor."""
        if name == "weight":
            return (self.out_sizes, 0) if self.layout == "col" else (self.in_sizes, 1)
        return self.out_sizes, 0  # bias, and weight_norm's g and v (col: rows)

    def slice_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` of parameter ``name`` (or of a same-shaped state)."""
        return self._slice_weight(full) if name != "bias" else self._slice_bias(full)

    def whole_weight(self, full: dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole layer's weight from its whole parameters ``full`` (by :data:`param_names`)."""
        if self.weight_norm_dim is None:
            return full["weight"]
        return weight_norm(full[V], full[G], self.weight_norm_dim)

    def _local_weight(self) -> torch.Tensor:
        """This rank's block of the weight, plain (weight_norm's rows from the blocks of ``g`` and ``v``)."""
        if self.weight_norm_dim is None:
            return local_block(self.weight)
        v, g = local_block(self.get_parameter(V)), local_block(self.get_parameter(G))
        return weight_norm(v, g, self.weight_norm_dim)

    # -- compute -------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs:  # user code calling the layer it indexed (the head passes its scale)
            raise RuntimeError(
                f"this is rank {self.rank}'s {self.layout} shard of a head layer nn.Linear({self.in_features}, "
                f"{self.out_features}) that strategy='hybrid_fc' splits over {self.k} ranks: called on its own it "
                "computes part of the layer. Call the model (or the container holding the head) as a whole while "
                "training; after the stage the strategy hands the layer back whole and it runs on its own"
            )
        return super().__call__(*args, **kwargs)

    def forward(
        self, x: torch.Tensor, grad_scale: float = 1.0, compute_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``col``: x (n, in) replicated -> (n, out block).  ``row``: x (n, in block) -> partial sums (n, out).

        ``grad_scale`` multiplies the gradients reaching the shard (1/K for the per-step update).
        ``compute_dtype``: the weight and bias are rounded to it (autocast's cast) and the product runs in ``x``'s
        float32, so a row layer's partial sums are not rounded before the ranks' sum (the head rounds the
        result, ``HybridHead._layers``)."""
        self.kfac_grad_scale = grad_scale
        if torch.is_grad_enabled():  # how the weight and bias gradients are rounded (autocast_grads.py)
            self.autocast_dtype = compute_dtype
        # the plain blocks: the layer's own products are the block's, whatever a user reduction over them means
        weight = scale_grad(self._local_weight(), grad_scale)
        bias = None if self.bias is None else scale_grad(local_block(self.bias), grad_scale)
        if compute_dtype is not None:
            weight = round_to(weight, compute_dtype)  # backward: the float32 gradient, not rounded
            bias = None if bias is None else round_to(bias, compute_dtype)
        if self.layout == "col":
            return F.linear(x, weight, bias)
        y = F.linear(x, weight)
        if bias is not None:
            a, b = self.out_bounds[self.rank]
            y = torch.cat([y[:, :a], y[:, a:b] + bias, y[:, b:]], 1)
        return y

    # -- checkpoints ---------------------------------------------------------------------------------------
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):  # type: ignore[override]
        # weight_norm's originals too: they belong to a child module, which loads after this one
        for name in self.param_names:
            key = prefix + name
            if key in state_dict and tuple(state_dict[key].shape) == self.full_shape(name):
                state_dict[key] = self.slice_full(name, state_dict[key])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, layout={self.layout}, rank {self.rank} of {self.k}"


def gather_shard_tensors(shards: dict[str, tuple[ShardedLinear, str, torch.Tensor]], group: Any, rank0_only: bool,
                         cpu: bool, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of shard-shaped tensors (key -> (shard, parameter name, this rank's tensor)) over the head's
    ``group`` (``None``: the world); with ``rank0_only`` only group rank 0 gets them (the other ranks get an empty
    dict).  Collective.  ``device``: the device the group's collectives run on, where tensors kept elsewhere travel
    (a weight-averaging copy on the host beside a model on a GPU: NCCL moves device tensors only); what is received
    lands where the tensors were (or on the host with ``cpu``).  Here, beside the shards, so that the head
    (whole-head inference) and the checkpoints (which find the head in a model) both use it without importing each
    other."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {key: local_block(value).detach().cpu() if cpu else local_block(value).detach()
                for key, (_, _, value) in shards.items()}
    local = {key: local_block(value).detach().contiguous() for key, (_, _, value) in shards.items()}
    split = {key: shard.shard_sizes(pname)[1] for key, (shard, pname, _) in shards.items()}
    dst = dist.get_global_rank(group, 0)
    full = gather_keyed_tensors(local, group, dst if rank0_only else None, split_dims=split,
                                device=device, out_device="cpu" if cpu else None)
    if rank0_only and dist.get_rank() != dst:
        return {}
    for key, (shard, pname, _) in shards.items():
        assert tuple(full[key].shape) == shard.full_shape(pname), (key, tuple(full[key].shape))
    return dict(full)

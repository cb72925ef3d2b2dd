"""One fully-connected layer of which this rank owns 1/K (column- or row-parallel, see ``layout.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.hybrid_fc.functions import scale_grad

__all__ = ["ShardedLinear"]


class ShardedLinear(nn.Module):
    """Shard of ``nn.Linear(in_features, out_features)`` owned by rank ``rank`` of ``k``.

    ``col``: ``weight = W[o0:o1]`` and ``bias = b[o0:o1]`` (block of output neurons).
    ``row``: ``weight = W[:, i0:i1]`` (block of input neurons) and ``bias = b[o0:o1]``; the bias block is added to
    the matching columns of the partial sum so the reduce-scatter that follows yields ``x W^T + b`` exactly.
    Blocks follow :func:`lightning_hpc.distributed.partition.block_bounds` (uneven sizes allowed).

    ``state_dict`` holds the shards under the names of ``nn.Linear``; ``load_state_dict`` accepts either a shard
    or the full tensor (which it slices), so a full checkpoint loads on any K.
    """

    def __init__(self, linear: nn.Linear, layout: str, rank: int, k: int) -> None:
        super().__init__()
        if layout not in ("col", "row"):
            raise ValueError(f"layout must be 'col' or 'row', got {layout!r}")
        self.layout, self.rank, self.k = layout, rank, k
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_bounds = block_bounds(self.out_features, k)
        self.in_bounds = block_bounds(self.in_features, k)
        w = linear.weight.detach()
        self.weight = nn.Parameter(self._slice_weight(w).clone())
        self.bias = None if linear.bias is None else nn.Parameter(self._slice_bias(linear.bias.detach()).clone())

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
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    def shard_sizes(self, name: str) -> tuple[list[int], int]:
        """(block sizes over ranks, dimension) of parameter ``name`` in the full tensor."""
        if name == "weight":
            return (self.out_sizes, 0) if self.layout == "col" else (self.in_sizes, 1)
        return self.out_sizes, 0

    def slice_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` of parameter ``name`` (or of a same-shaped state)."""
        return self._slice_weight(full) if name == "weight" else self._slice_bias(full)

    # -- compute -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """``col``: x (n, in) replicated -> (n, out block).  ``row``: x (n, in block) -> partial sums (n, out).

        ``grad_scale`` multiplies the gradients reaching the shard (1/K for the per-step update)."""
        weight = scale_grad(self.weight, grad_scale)
        bias = None if self.bias is None else scale_grad(self.bias, grad_scale)
        if self.layout == "col":
            return F.linear(x, weight, bias)
        y = F.linear(x, weight)
        if bias is not None:
            a, b = self.out_bounds[self.rank]
            y = torch.cat([y[:, :a], y[:, a:b] + bias, y[:, b:]], 1)
        return y

    # -- checkpoints ---------------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict and getattr(self, name) is not None and tuple(state_dict[key].shape) == self.full_shape(name):
                state_dict[key] = self.slice_full(name, state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, layout={self.layout}, rank {self.rank} of {self.k}"

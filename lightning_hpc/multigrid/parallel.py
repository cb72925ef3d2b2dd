"""Communication of the layer-parallel solver: a chain of ranks along the layer dimension.

Rank r of the layer group owns a contiguous range of steps (partition.py).  Relaxation on rank r needs the
state at the start of its range, which is the last C-point of rank r-1: it is exchanged before every
F-relaxation (the paper's "distributed memory communication ... during the C-relaxation phase for abutted
layer blocks residing on different GPUs", section III-D).  The adjoint runs the chain backwards.  With no
process group (one process) every operation is local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc.distributed.gradients import allreduce_flat

__all__ = ["LayerChain", "layer_data_groups", "average_gradients"]


class LayerChain:
    """Neighbours of this rank in the order the solve runs (forward: r-1 -> r -> r+1; adjoint: reversed).

    ``group`` is the layer-parallel process group (``None`` with ``ranks=None`` means a single process).
    Ranks are given as *global* ranks, as torch.distributed point-to-point calls expect.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, reverse: bool = False) -> None:
        self.group = group
        if group is None:
            self.ranks, self.index = [0], 0
        else:
            self.ranks = dist.get_process_group_ranks(group)
            self.index = self.ranks.index(dist.get_rank())
        self.reverse = reverse
        if reverse:
            self.ranks = self.ranks[::-1]
            self.index = len(self.ranks) - 1 - self.index
        self.size = len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    def exchange(self, last: torch.Tensor, ghost: torch.Tensor) -> None:
        """Send ``last`` (this rank's final point) to the next rank; receive ``ghost`` from the previous one."""
        if self.size == 1:
            return
        work = dist.isend(last.contiguous(), self.ranks[self.index + 1], group=self.group) if not self.is_last else None
        if not self.is_first:
            dist.recv(ghost, self.ranks[self.index - 1], group=self.group)
        if work is not None:
            work.wait()

    def recv_prev(self, ghost: torch.Tensor) -> None:
        if self.size > 1 and not self.is_first:
            dist.recv(ghost, self.ranks[self.index - 1], group=self.group)

    def send_next(self, last: torch.Tensor) -> None:
        if self.size > 1 and not self.is_last:
            dist.send(last.contiguous(), self.ranks[self.index + 1], group=self.group)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the chain (e.g. squared residual norms)."""
        if self.size > 1:
            dist.all_reduce(value, group=self.group)
        return value

    def all_gather(self, tensor: torch.Tensor, forward_order: bool = False) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in chain order (``forward_order``: in layer order,
        also on the reversed adjoint chain)."""
        if self.size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)  # group-rank order = layer order
        return out[::-1] if self.reverse and not forward_order else out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast from global rank ``src`` to the chain, in place."""
        if self.size > 1:
            dist.broadcast(tensor, src, group=self.group)
        return tensor


def layer_data_groups(
    layer_parallel_size: int, device_type: str = "cpu"
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int, int]:
    """The 2-D mesh data x layer (:func:`layer_data_mesh`): (data group, layer group, data index, layer index)
    of this rank.  Collective: every rank calls it."""
    mesh = layer_data_mesh(layer_parallel_size, device_type)
    rank = dist.get_rank()
    return mesh.get_group("data"), mesh.get_group("layer"), rank // layer_parallel_size, rank % layer_parallel_size


def layer_data_mesh(layer_parallel_size: int, device_type: str = "cpu") -> Any:
    """The ``("data", "layer")`` DeviceMesh of the world.

    Ranks r = d * P + l: the P ranks of one layer chain are contiguous (same node when P divides the ranks per
    node, where the boundary exchanges are cheapest); ranks with the same l hold the same layers and average
    their gradients over the data dimension.  Collective: every rank calls it.
    """
    from lightning_hpc.distributed.groups import MeshDim, build_mesh

    # validated (an error naming layer_parallel_size); the groups get the world's (the strategy's) timeout
    layer = MeshDim("layer", layer_parallel_size, setting=f"layer_parallel_size={layer_parallel_size}",
                    what="ranks of one layer-parallel chain")
    return build_mesh([MeshDim("data"), layer], device_type=device_type)


def average_gradients(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Average the ``.grad`` of ``params`` (those that have one) over ``group`` (one flat allreduce per dtype)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    allreduce_flat([p.grad for p in params if p.grad is not None], 1.0 / dist.get_world_size(group), group=group)

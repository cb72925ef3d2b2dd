"""Contiguous partition of the residual steps over the ranks of a layer-parallel group (paper Fig. 2/3:
"the layer blocks are distributed into contiguous model partitions across GPUs")."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hpc.distributed.partition import block_range

__all__ = ["LayerPartition", "check_layer_partition"]


def check_layer_partition(num_steps: int, ranks: int, cfactor: int, levels: int) -> None:
    """Raise a ValueError with the numbers unless every rank holds whole blocks on every level.

    Level l has N / c^l steps; the hierarchy is the same whatever the number of ranks only if each rank's share
    N / P is a multiple of c^(levels-1) (its first step is a C-layer on every coarse level).
    """
    if num_steps < 1 or ranks < 1:
        raise ValueError(f"need at least one residual step and one rank, got {num_steps} steps and {ranks} ranks")
    block = ranks * cfactor ** (levels - 1)
    if num_steps % block != 0:
        lower = (num_steps // block) * block
        use = f"{lower} or {lower + block}" if lower else f"{block}"  # fewer steps than one block: one choice
        raise ValueError(
            f"{num_steps} residual steps cannot be split into {ranks} layer-parallel rank(s) x blocks of "
            f"cfactor^(levels-1) = {cfactor}^{levels - 1} = {cfactor ** (levels - 1)} steps: the number of steps must "
            f"be a multiple of {block}. Use {use} steps, or change "
            "layer_parallel_size / cfactor / levels"
        )


@dataclass(frozen=True)
class LayerPartition:
    """Rank ``rank`` of ``ranks`` owns steps ``[start, stop)`` (and the states u_{start+1} .. u_stop)."""

    num_steps: int
    ranks: int
    rank: int
    cfactor: int
    levels: int

    def __post_init__(self) -> None:
        check_layer_partition(self.num_steps, self.ranks, self.cfactor, self.levels)

    @property
    def start(self) -> int:
        return block_range(self.num_steps, self.ranks, self.rank)[0]

    @property
    def stop(self) -> int:
        return block_range(self.num_steps, self.ranks, self.rank)[1]

    @property
    def local_steps(self) -> int:
        return self.stop - self.start

    def owner(self, step: int) -> int:
        """Rank owning global step ``step``."""
        return step // (self.num_steps // self.ranks)

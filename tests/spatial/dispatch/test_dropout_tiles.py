"""``F.dropout`` on a split activation: each tile's mask is, bit for bit, its part of the mask one process draws
for the whole activation from the same generator state, the generator ends where one process's ends, and no rank
holds the whole activation's mask or values (on the CPU, where torch draws the mask as one serial stream)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hpc.spatial.dispatch import SpatialTensor, split_tensor
from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.creation import _serial_dropout_stream
from lightning_hpc.spatial.layout.tiling import SpatialGrid


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op made inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


CASES = {  # global shape, parts of the spatial dimensions (uneven extents)
    "2x1": ((2, 3, 13, 10), (2, 1)),
    "1x2": ((2, 3, 13, 10), (1, 2)),
    "2x2": ((2, 3, 13, 10), (2, 2)),
    "1x1x2": ((2, 2, 5, 6, 7), (1, 1, 2)),
    "2x1x1": ((2, 2, 5, 6, 7), (2, 1, 1)),
    "1x3x1": ((1, 2, 5, 7, 6), (1, 3, 1)),
}


@pytest.mark.skipif(not _serial_dropout_stream(), reason="this torch does not draw the CPU dropout mask serially")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_tile_draws_its_part_of_one_process_mask_and_holds_no_whole_one(case, dtype):
    shape, parts = CASES[case]
    x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    sdims = tuple(range(2, len(shape)))
    torch.manual_seed(7)
    start = torch.get_rng_state()
    expected = F.dropout(x, 0.3, True)  # one process
    end = torch.get_rng_state()
    for rank in range(math.prod(parts)):
        grid = SpatialGrid(parts=parts, ranks=list(range(math.prod(parts))), group=None, local_rank=rank)
        index = _tile_index(shape, sdims, grid)
        tile = split_tensor(x[index].clone(), grid, shape)
        torch.set_rng_state(start)
        with LargestTensor() as largest:
            out = F.dropout(tile, 0.3, True)
        assert isinstance(out, SpatialTensor)
        assert torch.equal(out.local(), expected[index]), f"{case} tile {grid.index}: not one process's mask"
        assert torch.equal(torch.get_rng_state(), end), f"{case} tile {grid.index}: the generator moved elsewhere"
        # the tile's mask and output, a buffer of at most a quarter of the tile's uniforms (or one row)
        assert largest.numel <= tile.local().numel() < x.numel(), (case, largest.numel, tile.local().numel())


def test_inplace_dropout_and_the_edge_probabilities_match_one_process():
    shape, parts = CASES["1x2"]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grid = SpatialGrid(parts=parts, ranks=[0, 1], group=None, local_rank=1)
    index = _tile_index(shape, (2, 3), grid)
    for p in (0.0, 0.5, 1.0):
        torch.manual_seed(3)
        expected = F.dropout(x.clone(), p, True, inplace=True)
        end = torch.get_rng_state()
        torch.manual_seed(3)
        tile = split_tensor(x[index].clone(), grid, shape)
        out = F.dropout(tile, p, True, inplace=True)
        assert torch.equal(out.local(), expected[index]) and torch.equal(torch.get_rng_state(), end), p

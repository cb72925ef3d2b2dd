"""The one full-state gather (``gather_keyed_tensors``): owned keys (one rank holds the tensor) and split keys
(every rank holds a slice) arrive whole on the destination, in small buckets, onto the device asked for; the
other ranks keep their own tensors; ``take_slice`` cuts a rank's slice back out."""

import pytest
import torch

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_sizes
from lightning_hpc.distributed.state import gather_keyed_tensors, take_slice

ROWS, COLS = 7, 5  # split unevenly over 2 and 3 ranks


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),  # split by rows
        "v": torch.randn(3, ROWS, generator=g, dtype=torch.float64),  # split by columns
        "steps": torch.arange(ROWS, dtype=torch.int64),  # split, another dtype
    }


def _local(rank: int, world: int) -> dict[str, torch.Tensor]:
    full = _full()
    sizes = block_sizes(ROWS, world)
    local = {
        "w": take_slice(full["w"], 0, sizes, rank),
        f"owned{rank}": torch.full((rank + 1, 2), float(rank)),  # owned: one per rank
        "v": take_slice(full["v"], 1, sizes, rank),
        "steps": take_slice(full["steps"], 0, sizes, rank),
    }
    if rank == 0:
        local["scalar"] = torch.tensor(3.0, dtype=torch.float64)
    return local


def _gather(rank: int, world: int, dst) -> dict:
    split = {"w": 0, "v": 1, "steps": 0}
    out = gather_keyed_tensors(_local(rank, world), torch.distributed.group.WORLD, dst, split_dims=split,
                               out_device="cpu", bucket_bytes=40)
    return {"keys": list(out), **{k: v.clone().numpy() for k, v in out.items()}}


def _expected(world: int) -> dict[str, torch.Tensor]:
    full = _full()
    owned = {f"owned{r}": torch.full((r + 1, 2), float(r)) for r in range(world)}
    return {**full, **owned, "scalar": torch.tensor(3.0, dtype=torch.float64)}


@pytest.mark.parametrize("world,dst", [(2, 0), (3, 1), (3, None)])
def test_owned_and_split_keys_arrive_whole(world, dst):
    out = run_in_processes(_gather, world, dst)
    expected = _expected(world)
    receivers = range(world) if dst is None else [dst]
    for r in receivers:
        # by group rank, then in each rank's own order
        assert out[r]["keys"] == ["w", "owned0", "v", "steps", "scalar"] + [f"owned{o}" for o in range(1, world)]
        for key, value in expected.items():
            assert torch.equal(torch.as_tensor(out[r][key]), value), (r, key)
    for r in set(range(world)) - set(receivers):  # the others keep exactly their own tensors
        mine = _local(r, world)
        assert out[r]["keys"] == list(mine)
        assert all(torch.equal(torch.as_tensor(out[r][k]), v) for k, v in mine.items())


def test_take_slice_is_the_inverse_and_checks_sizes():
    full = _full()["w"]
    sizes = block_sizes(ROWS, 3)
    assert torch.equal(torch.cat([take_slice(full, 0, sizes, r) for r in range(3)]), full)
    with pytest.raises(ValueError, match="cannot be split"):
        take_slice(full, 1, sizes, 0)

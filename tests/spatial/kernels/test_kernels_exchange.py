"""The N-d halo exchange (section III-A) over 1-, 2- and 3-D splits: the plan's messages (faces, edges and corners
in one round, direction tags), the assembled box equal to the padded global tensor's box, the backward exchange
the adjoint of the forward one (dot-product test), the acceptance check's error, and negative controls that the
checks must catch (a direction dropped from the plan; a kernel without its halo)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial import kernels as K
from lightning_hpc.spatial.kernels import pooling as kernel_pooling
from lightning_hpc.spatial.layout.halo_exchange import (
    BACKWARD_TAG_OFFSET,
    HaloPlan,
    PartitionError,
    Window1d,
    direction_delta,
    direction_id,
    halo_exchange,
)
from lightning_hpc.spatial.layout.tiling import SpatialGrid, create_hybrid_layout, tile_slices

#: in the torch-range subset, run on the oldest and newest torch release (bash scripts/dev.sh torch-range)
pytestmark = pytest.mark.torch_range

GRIDS_2 = [(2,), (2, 1), (1, 2), (2, 1, 1), (1, 1, 2), (1, 2, 1)]
GRIDS_4 = [(2, 2), (2, 2, 1), (1, 2, 2)]
EXTENTS = {1: (13,), 2: (9, 13), 3: (6, 9, 7)}
# per dimension: same 3-window, strided 3/s2/p1, and the asymmetric 'same' padding of an even kernel
WINDOWS = [Window1d(3, 1, 1), Window1d(3, 2, 1), Window1d(4, 1, 1, padding_hi=2), Window1d(5, 1, 2, 1)]


def _grid(parts: tuple[int, ...], index: tuple[int, ...]) -> SpatialGrid:
    size = 1
    for p in parts:
        size *= p
    g = SpatialGrid(parts=parts, ranks=list(range(size)), group=None, local_rank=0)
    g.local_rank = g.position(*index)
    return g


def test_direction_ids_fit_the_tag_room_and_invert():
    for k in (1, 2, 3):
        ids = {direction_id(d): d for d in itertools.product((-1, 0, 1), repeat=k)}
        assert len(ids) == 3**k and max(ids) < 27
        assert all(direction_delta(i, k) == d for i, d in ids.items())
    # forward and backward tags of one exchange stay inside the 64 tags next_tag() reserves
    assert BACKWARD_TAG_OFFSET >= 27 and BACKWARD_TAG_OFFSET + 26 < 64


def test_centre_tile_of_3x3x3_grid_talks_to_26_neighbours_in_one_round():
    grid = _grid((3, 3, 3), (1, 1, 1))
    extents = (12, 12, 12)
    plan = K.halo_plan(grid, extents, [Window1d(3, 1, 1)] * 3)
    assert len(plan.sends) == len(plan.recvs) == 26
    assert len({d for _, d, *_ in plan.sends}) == 26
    # a corner block is one element, an edge block one line, a face block one plane of the tile (4 x 4 x 4)
    sizes = sorted((r[0][1] - r[0][0]) * (r[1][1] - r[1][0]) * (r[2][1] - r[2][0]) for _, _, *r in plan.sends)
    assert sizes == [1] * 8 + [4] * 12 + [16] * 6
    assert plan.need == ((3, 9), (3, 9), (3, 9))


def test_border_tile_plan_pads_only_outside_the_sample():
    grid = _grid((2, 1, 2), (0, 0, 1))
    plan = K.halo_plan(grid, (6, 5, 7), [Window1d(3, 1, 1)] * 3)
    # beyond the sample only where it ends: D before (first tile), H on both sides (whole), W after (last tile)
    assert plan.need == ((-1, 4), (-1, 6), (3, 8)) and plan.need_clamped == ((0, 4), (0, 5), (3, 7))
    assert {d for _, d, *_ in plan.recvs} == {direction_id((-1, 0, 1)), direction_id((0, 0, 1)),
                                              direction_id((-1, 0, 0))}


def test_acceptance_check_names_the_dimension_and_the_largest_split():
    wins = K.convolution_windows((4, 4, 5, 5), padding=2)
    K.check_partition((9, 4), (1, 2), wins)
    with pytest.raises(PartitionError, match=r"split 1x4: W: tile .*largest split of W \(split dimension 1\) that "
                                             r"works is 2"):
        K.check_partition((9, 4), (1, 4), wins)
    assert K.largest_split(4, 4, wins[1]) == 2


def test_kernel_call_on_thin_tiles_raises_before_any_message():
    # 4 tiles of 2 along W, a 7-wide window: the halo (3) is thicker than a neighbour's tile
    grid = _grid((1, 4), (0, 1))
    x = torch.zeros(1, 2, 8, 2)
    with pytest.raises(PartitionError, match=r"conv2d: .*W: tile .*largest split of W .* is 3"):
        K.conv(x, torch.zeros(2, 2, 7, 7), None, grid, (8, 8), padding=3)
    with pytest.raises(PartitionError, match="not block"):  # a tile that is not this rank's block
        K.max_pool(torch.zeros(1, 2, 8, 3), grid, (8, 8), 3, 1, 1)


def test_window_functions_follow_torch_arguments():
    same = K.convolution_windows((4, 2, 4, 2, 3), padding="same", dilation=(1, 3, 1))
    assert [(w.padding, w.pad_after) for w in same] == [(1, 2), (1, 2), (1, 1)]
    assert [w.out_size(9) for w in same] == [9, 9, 9]
    assert [w.out_size(9) for w in K.pooling_windows(2, 3, 2, 1, ceil_mode=True)] == [5, 5]
    assert K.transposed_windows((4, 6, 3), 2, 1, 1)[0].out_size(7) == 14
    assert [w.n_out for w in K.interpolation_windows((9, 13), scale_factor=1.7)] == [15, 22]
    assert K.adaptive_windows(10, 3) == [(0, 4), (3, 7), (6, 10)]


def _padded_box(x: torch.Tensor, plan: HaloPlan, pad_value: float) -> torch.Tensor:
    """The reference: the global tensor padded with ``pad_value``, cut to ``plan.need``."""
    k = plan.ndim
    margin = 8
    xp = F.pad(x, [margin] * (2 * k), value=pad_value)
    return xp[(Ellipsis, *(slice(lo + margin, hi + margin) for lo, hi in plan.need))]


def _drop(plan: HaloPlan, direction: int) -> HaloPlan:
    """A copy of ``plan`` without the messages sent in ``direction`` (on both ends, so nothing waits)."""
    bad = object.__new__(HaloPlan)
    bad.__dict__.update(plan.__dict__)
    bad.sends = [m for m in plan.sends if m[1] != direction]
    bad.recvs = [m for m in plan.recvs if m[1] != direction]
    return bad


def _no_halo(x: torch.Tensor, plan: HaloPlan, *, pad_value: float = 0.0) -> torch.Tensor:
    """A "halo exchange" that sends nothing: the tile cut or padded to the needed box."""
    pads = []
    for (lo, hi), (a, b) in zip(reversed(plan.need), reversed(plan.own)):
        pads += [a - lo, hi - b]
    return F.pad(x, pads, value=pad_value)


def _exchange_matrix(rank: int, world: int, grids: list[tuple[int, ...]]) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    out: dict[str, list[str]] = {"fails": [], "caught": [], "missed": []}
    for parts in grids:
        grid = create_hybrid_layout(parts).grid
        k = grid.ndim
        ext = EXTENTS[k]
        x = torch.randn(2, 3, *ext, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        for wi, win in enumerate(WINDOWS):
            plan = K.halo_plan(grid, ext, [win] * k)
            tile = x[(Ellipsis, *tile_slices(ext, parts, grid.index))].clone().requires_grad_(True)
            for pad_value in (0.0, -1.5):
                box = halo_exchange(tile, plan, pad_value=pad_value)
                if not torch.equal(box.detach(), _padded_box(x, plan, pad_value)):
                    out["fails"].append(f"box {parts} window {wi} pad {pad_value}")
            # dot-product test: <A x, g> = <x, A^T g> summed over the group, A^T the backward exchange
            g = torch.randn(box.shape, generator=torch.Generator().manual_seed(100 + rank + wi), dtype=box.dtype)
            tile.grad = None
            box = halo_exchange(tile, plan)
            (box * g).sum().backward()
            dots = torch.stack([(box.detach() * g).sum(), (tile.detach() * tile.grad).sum()])
            dist.all_reduce(dots, group=grid.group)
            if not abs(float(dots[0] - dots[1])) <= 1e-12 * max(1.0, abs(float(dots[0]))):
                out["fails"].append(f"adjoint {parts} window {wi}: {dots.tolist()}")
            # negative control: each direction, dropped from the plan in turn (every rank drops the same one, so
            # the ranks stay in step), must be noticed wherever some rank sends in it
            for d in range(3**k):
                used = any(m[1] == d for m in plan.sends)
                try:
                    wrong = halo_exchange(tile.detach(), _drop(plan, d))
                    ok = torch.equal(wrong, _padded_box(x, plan, 0.0))
                except RuntimeError:  # the box cannot even be assembled
                    ok = False
                flags = torch.tensor([0.0 if ok else 1.0, float(used)], dtype=torch.float64)
                dist.all_reduce(flags, group=grid.group)
                if flags[1] > 0:
                    out["caught" if flags[0] > 0 else "missed"].append(f"{parts} window {wi} direction {d}")
        # negative control for the kernel comparison: max pooling without its halo must differ somewhere
        real = kernel_pooling.halo_exchange
        kernel_pooling.halo_exchange = _no_halo
        try:
            y = K.max_pool(x[(Ellipsis, *tile_slices(ext, parts, grid.index))], grid, ext, 3, 1, 1)
        finally:
            kernel_pooling.halo_exchange = real
        want = F.max_pool3d if k == 3 else (F.max_pool2d if k == 2 else F.max_pool1d)
        ref = want(x, 3, 1, 1)
        wrong = torch.tensor([0.0 if torch.equal(y, ref[(Ellipsis, *tile_slices(ref.shape[-k:], parts,
                                                                                  grid.index))]) else 1.0])
        dist.all_reduce(wrong, group=grid.group)
        out["caught" if wrong.item() > 0 else "missed"].append(f"{parts} max_pool without halo")
    return out


@pytest.mark.parametrize("world,grids", [(2, GRIDS_2), (4, GRIDS_4)], ids=["2proc", "4proc"])
def test_nd_exchange_box_adjoint_and_negative_controls(world: int, grids: list[tuple[int, ...]]) -> None:
    results = run_in_processes(_exchange_matrix, world, grids, timeout_s=300)
    fails = sorted({f for r in results for f in r["fails"]})
    assert not fails, "\n".join(fails[:40])
    missed = sorted({f for r in results for f in r["missed"]})
    assert not missed, "a sabotaged exchange went unnoticed:\n" + "\n".join(missed[:40])
    assert results[0]["caught"], "no negative control ran"

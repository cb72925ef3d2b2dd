"""The halo plan exchanges exactly the rows/columns each tile's output windows need (section III-A)."""

from __future__ import annotations

from lightning_hpc.spatial.layout.halo_exchange import DimPlan, HaloPlan, Window1d
from lightning_hpc.spatial.layout.tiling import SpatialGrid


def _plan(n: int, parts: int, win: Window1d) -> DimPlan:
    return DimPlan(n, win.out_size(n), parts, win)


def _received(plan: DimPlan, p: int) -> list[tuple[int, int]]:
    return [plan.recv_range(p, d) for d in (-1, 1) if 0 <= p + d < plan.parts]


def test_same_convolution_receives_floor_k_over_2_times_dilation_rows():
    for k, d in ((3, 1), (5, 1), (7, 1), (3, 2)):
        halo = (k // 2) * d
        plan = _plan(40, 4, Window1d(k, 1, halo, d))
        for p in range(4):
            for (s, e) in _received(plan, p):
                assert e - s == halo, (k, d, p, _received(plan, p))


def test_pointwise_and_aligned_stride2_1x1_send_nothing():
    assert all(e == s for p in range(4) for (s, e) in _received(_plan(19, 4, Window1d(1)), p))
    assert all(e == s for p in range(2) for (s, e) in _received(_plan(16, 2, Window1d(1, 2)), p))


def test_strided_windows_need_asymmetric_halos():
    # 3x3/s2/p1 on 16 rows over 2 tiles: output rows 0-3 | 4-7; tile 1's first output (row 4) reads input 7,
    # owned by tile 0; tile 0's last output (row 3) reads input rows 5-7, all its own: one-sided exchange
    plan = _plan(16, 2, Window1d(3, 2, 1))
    assert plan.recv_range(0, 1) == (8, 8) and plan.recv_range(1, -1) == (7, 8)
    # 7x7/s2/p3 (ResNet stem) on 16 rows: tile 1 needs input rows 5..7 from tile 0, tile 0 needs row 8..9
    plan = _plan(16, 2, Window1d(7, 2, 3))
    assert plan.recv_range(1, -1) == (5, 8) and plan.recv_range(0, 1) == (8, 10)


def test_2d_plan_sends_corners_directly_and_nothing_else():
    grid = SpatialGrid(parts=(2, 2), ranks=[0, 1, 2, 3], group=None, local_rank=0)
    win = Window1d(3, 1, 1)
    plan = HaloPlan(grid, _plan(10, 2, win), _plan(9, 2, win))
    sent = {peer: (r, c) for peer, _, r, c in plan.sends}
    assert set(sent) == {1, 2, 3}
    assert sent[3] == ((4, 5), (4, 5))  # the single corner element goes to the diagonal neighbour
    assert sent[2] == ((4, 5), (0, 5))  # one row down
    assert sent[1] == ((0, 5), (4, 5))  # one column right

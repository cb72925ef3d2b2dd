"""KAISA's gradient-worker fraction (SC21, section 3): 2 and 4 gloo processes, every placement and every valid
fraction (MEM-OPT 1/world, HYBRID-OPT, COMM-OPT 1) give the preconditioned gradients and parameters of one
process on the same global batch (float64: 1e-12, float32: 1e-5); each rank holds exactly the decompositions
of its gradient-worker group; the bytes every rank hands to the collectives equal plan-kfac's figures."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn

from lightning_hpc.cli.plan_kfac import communication_plan
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.distributed.groups import group_timeout
from lightning_hpc.kfac import PLACEMENTS, KFACOptions, KFACPreconditioner
from lightning_hpc.kfac.placement import GradWorkerGrid, grad_workers_for, make_placement

STEPS = 5
GLOBAL_BATCH = 16
FRACTIONS = {2: (0.5, 1.0), 4: (0.25, 0.5, 1.0)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {"float64": 1e-12, "float32": 1e-5}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 3 * 3, 12), nn.ReLU(), nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 5),
    ).to(dtype)


def _data(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 2, 7, 7, generator=g).to(dtype), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


class ByteCounter(TorchDistributedCommunicator):
    """Bytes of every tensor handed to an allreduce / a broadcast (counted on every participant)."""

    def __init__(self) -> None:
        self.allreduce_bytes = 0
        self.broadcast_bytes = 0

    def allreduce(self, tensor, op="mean", group=None, async_op=False):
        self.allreduce_bytes += tensor.numel() * tensor.element_size()
        return super().allreduce(tensor, op=op, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        self.broadcast_bytes += tensor.numel() * tensor.element_size()
        return super().broadcast(tensor, src=src, group=group, async_op=async_op)


def _train(
    rank: int, world_size: int, placement: str, fraction: float | None, dtype_name: str, steps: int = STEPS, **kw
) -> dict:
    dtype = DTYPES[dtype_name]
    model = _model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = ByteCounter()
    pre = KFACPreconditioner(
        model, optimizer=opt, factor_update_freq=2, inv_update_freq=4, damping=0.05, kl_clip=0.01, placement=placement,
        grad_worker_fraction=fraction, decomposition_dtype=dtype_name, communicator=comm, announce=False,
        **{"factor_dtype": dtype_name, **kw},
    )
    per_rank = GLOBAL_BATCH // world_size
    traffic, held = [], []
    for step in range(steps):
        x, y = _data(step, dtype)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients_like_ddp(model)  # the strategy's gradient allreduce
        a0, b0 = comm.allreduce_bytes, comm.broadcast_bytes
        pre.step()
        traffic.append((comm.allreduce_bytes - a0, comm.broadcast_bytes - b0))
        held.append(sorted(pre.decompositions))
        opt.step()
    # numpy, not tensors: tensors cross the result queue through shared memory that dies with the rank
    return {
        "params": [p.detach().numpy().copy() for p in model.parameters()],
        "precond": [p.grad.numpy().copy() for p in model.parameters()],  # the last step's preconditioned gradients
        "traffic": traffic,
        "held": held,
        "columns": pre.layer_columns(),
        "names": [h.name for h in pre.handlers],
        "fraction": pre.grad_worker_fraction,
        "stored": sorted({str(v.dtype) for d in pre.decompositions.values() for v in d.values()}),
        # HYBRID-OPT's own groups (None: the world, or unused) and the timeout they were created with
        "group_timeouts": [
            None if g is None else group_timeout(g).total_seconds() for g in (pre._column_group, pre._row_group)
        ],
    }


def _run_all(rank: int, world_size: int) -> dict:
    return {
        (pl, f, d): _train(rank, world_size, pl, f, d)
        for pl in PLACEMENTS
        for f in FRACTIONS[world_size]
        for d in DTYPES
    }


def _close(got, want, tol, what):
    for a, b in zip(got, want):
        torch.testing.assert_close(
            torch.from_numpy(a), torch.from_numpy(b), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}"
        )


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: slow tier
def test_every_fraction_and_placement_equals_one_process(world_size):
    refs = {d: _train(0, 1, "balanced", None, d) for d in DTYPES}
    results = run_in_processes(_run_all, world_size, timeout_s=600, collective_timeout_s=120)
    dims = None
    for (placement, fraction, dtype_name), res in results[0].items():
        what = f"{world_size} ranks, {placement}, fraction {fraction}, {dtype_name}"
        assert res["fraction"] == fraction
        for rank, out in enumerate(results):
            mine = out[(placement, fraction, dtype_name)]
            _close(mine["params"], refs[dtype_name]["params"], TOL[dtype_name], f"{what}, rank {rank}, parameters")
            _close(
                mine["precond"],
                refs[dtype_name]["precond"],
                TOL[dtype_name],
                f"{what}, rank {rank}, preconditioned gradients",
            )
            # each rank holds the decompositions of its gradient-worker group's layers, and only those
            grid = GradWorkerGrid(world_size, grad_workers_for(fraction, world_size))
            want_held = sorted(n for n, c in zip(mine["names"], mine["columns"]) if c == grid.column_of(rank))
            assert all(h == want_held for h in mine["held"]), (what, rank, mine["held"], want_held)
            if fraction == 1.0:
                assert len(want_held) == len(mine["names"])
            if fraction == 1 / world_size:
                assert len(want_held) < len(mine["names"])
            # bytes per step kind: plan-kfac's per-rank figures (float32 and float64 elements alike)
            if dims is None:
                model = _model(torch.float32)
                dims = [
                    (m.weight[0].numel() + 1, m.weight.shape[0])
                    for m in model.modules()
                    if isinstance(m, (nn.Conv2d, nn.Linear))
                ]
            size = 8 if dtype_name == "float64" else 4
            plan = communication_plan(
                dims, world_size, placement, fraction, element_bytes=size, decomposition_bytes=size
            )
            r = plan["ranks"][rank]
            # steps 0 and 4: factors + decompositions + gradients; step 2: factors + gradients; 1, 3: gradients
            want = [
                (r["factor_allreduce_bytes"], r["decomposition_broadcast_bytes"] + r["gradient_broadcast_bytes"]),
                (0, r["gradient_broadcast_bytes"]),
                (r["factor_allreduce_bytes"], r["gradient_broadcast_bytes"]),
                (0, r["gradient_broadcast_bytes"]),
                (r["factor_allreduce_bytes"], r["decomposition_broadcast_bytes"] + r["gradient_broadcast_bytes"]),
            ]
            assert mine["traffic"] == want, (what, rank, mine["traffic"], want)
            assert (r["gradient_broadcast_bytes"] == 0) == (fraction == 1.0)
            assert (r["decomposition_broadcast_bytes"] == 0) == (fraction == 1 / world_size)
            # groups of their own only in between, with the world's timeout (run_in_processes: 120 s), not torch's 30
            # min
            hybrid = 1 / world_size < fraction < 1
            assert mine["group_timeouts"] == ([120.0, 120.0] if hybrid else [None, None]), (
                what,
                mine["group_timeouts"],
            )


def test_mem_opt_is_layer_wise_and_comm_opt_is_the_placement():
    """Fraction 1/world reproduces K-FAC-lw's assignment (layer i -> rank i mod world) for every placement's
    layer_wise, and fraction 1 the placement's own factor assignment over the world."""
    dims = [(19, 6), (55, 8), (73, 12), (13, 9), (10, 5)]
    for world in (2, 4):
        lw = make_placement("layer_wise")
        columns, owners = lw.assign_grid(dims, GradWorkerGrid(world, 1))
        assert columns == [i % world for i in range(len(dims))]
        assert owners == lw.assign(dims, world)
        for name in PLACEMENTS:
            policy = make_placement(name)
            columns, owners = policy.assign_grid(dims, GradWorkerGrid(world, world))
            assert columns == [0] * len(dims) and owners == policy.assign(dims, world)
        # HYBRID-OPT on 4 ranks: 2 columns {0, 2} and {1, 3}; a layer's factors stay in its column
        for name in PLACEMENTS:
            columns, owners = make_placement(name).assign_grid(dims, GradWorkerGrid(4, 2))
            for i, c in enumerate(columns):
                assert {owners[(i, "A")], owners[(i, "G")]} <= set(GradWorkerGrid(4, 2).column(c))


def test_grid_groups():
    g = GradWorkerGrid(8, 4)
    assert g.num_groups == 2 and g.column(1) == (1, 3, 5, 7) and g.row(2) == (4, 5)
    assert g.source(1, 4) == 5 and g.source(0, 5) == 4 and g.source(1, 5) == 5


@pytest.mark.parametrize(
    "fraction,world,match",
    [(0.0, 4, "in \\(0, 1\\]"), (1.5, 4, "in \\(0, 1\\]"), (-0.5, 2, "in \\(0, 1\\]"), (True, 2, "in \\(0, 1\\]"),
     (0.3, 4, "1/4, 2/4, 4/4"), (0.75, 4, "integer that divides"), (0.5, 3, "1/3, 3/3"), (1 / 3, 6, None)],
)
def test_fraction_is_validated_up_front(fraction, world, match):
    if match is None:
        assert grad_workers_for(fraction, world) == 2  # 1/3 of 6 ranks despite the rounding of 1/3
        return
    if "(0, 1" in match:
        with pytest.raises(ValueError, match=match):
            KFACOptions(grad_worker_fraction=fraction)
    with pytest.raises(ValueError, match=match):
        grad_workers_for(fraction, world)


def test_one_process_accepts_fraction_one_and_refuses_others():
    model = _model(torch.float32)
    pre = KFACPreconditioner(model, grad_worker_fraction=1.0, announce=False)
    assert pre.grad_worker_fraction == 1.0 and pre.grid.grad_workers == 1
    with pytest.raises(ValueError, match="grad_worker_fraction=0.5 on 1 ranks"):
        KFACPreconditioner(model, grad_worker_fraction=0.5, announce=False)


def test_communication_plan_hand_computed():
    """Two layers, A/G sides (3, 2) and (5, 4), 2 ranks, float32, eigen (n + n^2 elements per decomposition)."""
    dims = [(3, 2), (5, 4)]
    mem = communication_plan(dims, 2, "layer_wise", 0.5)  # MEM-OPT: layer 0 on rank 0, layer 1 on rank 1
    comm = communication_plan(dims, 2, "layer_wise", 1.0)  # COMM-OPT: every rank holds both layers
    factors = (9 + 4 + 25 + 16) * 4  # every rank holds every running factor
    triangles = (6 + 3 + 15 + 10) * 4 + 2 * 4  # upper triangles + one "hooks fired" flag per layer
    r0, r1 = mem["ranks"]
    assert (mem["grad_workers"], mem["worker_groups"], comm["grad_workers"], comm["worker_groups"]) == (1, 2, 2, 1)
    assert r0["factors_bytes"] == r1["factors_bytes"] == factors == 216
    assert (
        r0["decompositions_bytes"] == (3 + 9 + 2 + 4) * 4 == 72
        and r1["decompositions_bytes"] == (5 + 25 + 4 + 16) * 4 == 200
    )
    assert (r0["memory_bytes"], r1["memory_bytes"], mem["max_memory_bytes"]) == (288, 416, 416)
    assert r0["factor_allreduce_bytes"] == r1["factor_allreduce_bytes"] == triangles == 144
    assert r0["decomposition_broadcast_bytes"] == r1["decomposition_broadcast_bytes"] == 0
    assert r0["gradient_broadcast_bytes"] == r1["gradient_broadcast_bytes"] == (2 * 3 + 4 * 5) * 4 == 104
    assert r0["bytes_per_step"] == pytest.approx(144 / 10 + 104)
    for r in comm["ranks"]:
        assert r["decompositions_bytes"] == 272 and r["memory_bytes"] == 488
        assert r["decomposition_broadcast_bytes"] == 272 and r["gradient_broadcast_bytes"] == 0
        assert r["bytes_per_step"] == pytest.approx(144 / 10 + 272 / 100)
    full = communication_plan(
        dims, 2, "layer_wise", 1.0, symmetric_allreduce=False, compute_method="inverse", inverse_bytes=2
    )
    assert full["ranks"][0]["factor_allreduce_bytes"] == factors + 8
    assert full["ranks"][0]["decompositions_bytes"] == (9 + 4 + 25 + 16) * 2  # bf16 inverses
    single = communication_plan(dims, 1, "balanced", None)["ranks"][0]
    assert (
        single["factor_allreduce_bytes"]
        == single["decomposition_broadcast_bytes"]
        == single["gradient_broadcast_bytes"]
        == 0
    )


def test_plan_kfac_reports_every_fraction(capsys):
    from lightning_hpc.cli import plan_kfac as plan_mod

    assert plan_mod.main(["--model", "cifar_resnet20", "--world-size", "4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    kaisa = p["grad_worker_fractions"]
    assert [k["grad_worker_fraction"] for k in kaisa] == [0.25, 0.5, 1.0]
    memory = [k["max_memory_bytes"] for k in kaisa]
    assert memory[0] < memory[1] < memory[2]  # more gradient workers: more decompositions per rank
    assert [k["ranks"][0]["gradient_broadcast_bytes"] > 0 for k in kaisa] == [True, True, False]
    assert plan_mod.main(["--model", "cifar_resnet20", "--world-size", "8", "--grad-worker-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "grad_worker_fraction (KAISA)" in out and "\n      0.5        4 " in out
    with pytest.raises(SystemExit):
        plan_mod.main(["--world-size", "4", "--grad-worker-fraction", "0.3"])


def _run_half_storage(rank: int, world_size: int) -> dict:
    return {
        f: _train(rank, world_size, "balanced", f, "float32", factor_dtype="bfloat16", inverse_dtype="bfloat16")
        for f in (0.5, 1.0)
    }


def test_half_precision_storage_over_the_collectives():
    """bfloat16 factors and decompositions on 2 ranks: the decompositions travel in bfloat16 (half plan-kfac's
    float32 bytes), every rank ends with the same parameters, and they stay close to one process with the same
    storage (not bitwise: float32 factor averages that differ in the last bit may round to different bfloat16)."""
    ref = _train(0, 1, "balanced", None, "float32", factor_dtype="bfloat16", inverse_dtype="bfloat16")
    results = run_in_processes(_run_half_storage, 2, timeout_s=300, collective_timeout_s=120)
    model = _model(torch.float32)
    dims = [
        (m.weight[0].numel() + 1, m.weight.shape[0]) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    for fraction in (0.5, 1.0):
        for rank, out in enumerate(results):
            mine = out[fraction]
            assert mine["stored"] == ["torch.bfloat16"]
            _close(mine["params"], results[0][fraction]["params"], 0, f"rank {rank} vs rank 0, fraction {fraction}")
            _close(mine["params"], ref["params"], 2e-2, f"rank {rank} vs one process, fraction {fraction}")
            r = communication_plan(dims, 2, "balanced", fraction, inverse_bytes=2, factor_bytes=2)["ranks"][rank]
            assert mine["traffic"][0] == (
                r["factor_allreduce_bytes"],
                r["decomposition_broadcast_bytes"] + r["gradient_broadcast_bytes"],
            )
            if fraction == 1.0:
                full = communication_plan(dims, 2, "balanced", fraction)["ranks"][rank]
                assert 2 * r["decomposition_broadcast_bytes"] == full["decomposition_broadcast_bytes"] > 0

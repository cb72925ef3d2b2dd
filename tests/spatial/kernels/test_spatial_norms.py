"""Group, instance and layer normalisation over split activations (statistics aggregated over the spatial group)
against the serial op: outputs, input and parameter gradients, running statistics, at 2x1 and 1x2 with uneven
tiles (13 x 11 over 2 parts), in float32 and float64, and bf16 autocast; nothing may be gathered."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import on_unsupported, split_tensor, state
from lightning_hpc.spatial.kernels import normalization
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from tests.spatial.spatial_checks import max_err, serial_sgd_fit, tile_of

N, C, H, W = 3, 6, 13, 11
PARTS = [(2, 1), (1, 2)]
TOLS = {torch.float32: 1e-5, torch.float64: 1e-11}


def _layers():
    return {
        "GroupNorm(2, 6)": nn.GroupNorm(2, C),
        "GroupNorm(3, 6, affine=False)": nn.GroupNorm(3, C, affine=False),
        "InstanceNorm2d(6)": nn.InstanceNorm2d(C),
        "InstanceNorm2d(6, affine, track_running_stats)": nn.InstanceNorm2d(C, affine=True, track_running_stats=True),
        "LayerNorm([C, H, W])": nn.LayerNorm([C, H, W]),
        "LayerNorm([C, H, W], no affine)": nn.LayerNorm([C, H, W], elementwise_affine=False),
        "LayerNorm([H, W])": nn.LayerNorm([H, W]),
    }


def _init(m: nn.Module, dtype) -> nn.Module:
    m = m.to(dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5 + 1.0)
    return m


def _compare(ref: nn.Module, x: torch.Tensor, grid, step: int) -> dict[str, float]:
    """One forward/backward of ``ref`` (serial, whole x) and of a copy of it on this rank's split tile."""
    ref.zero_grad(set_to_none=True)
    sp = copy.deepcopy(ref)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(11 + step), dtype=yr.dtype)
    (yr * g).sum().backward()
    xt = tile_of(x, grid).clone().requires_grad_(True)
    ys = sp(split_tensor(xt, grid, x.shape))
    (ys * g).sum().backward()
    errs = {"out": max_err(ys.full(), yr), "dx": max_err(xt.grad, tile_of(xr.grad, grid))}
    for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
        gs = ps.grad.clone()
        dist.all_reduce(gs, group=grid.group)  # tile parts: the strategy sums them over the spatial group
        errs[f"d{name}"] = max_err(gs, pr.grad)
    with torch.no_grad():  # carry the running statistics on as the serial layer does
        for (name, br), bs in zip(ref.named_buffers(), sp.buffers()):
            errs[name] = max_err(bs, br)
            br.copy_(bs)
    return errs


def _norms(rank: int, world: int, dtypes, sabotage: str = "", parts_list=tuple(PARTS)) -> list[str]:
    if sabotage == "local_statistics":  # what the check must catch: tile-local statistics
        normalization._combine = lambda mean, var, m, group: (mean.double(), var.double(), float(m))
    elif sabotage == "local_backward":  # and a backward without the sums over the group
        normalization._sum_over_group = lambda sums, group: sums * dist.get_world_size(group)
    fails: list[str] = []
    for parts in parts_list:
        grid = create_hybrid_layout(parts).grid
        for dtype in dtypes:
            tol = TOLS[dtype] * (5 if grid.size > 2 and dtype == torch.float32 else 1)
            for name, layer in _layers().items():
                ref = _init(layer, dtype)
                with on_unsupported("error"):  # a gather would raise: these ops must be tiled
                    for step in range(3):
                        x = (
                            torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(step), dtype=dtype)
                            * (step + 1)
                            + 3.0
                        )
                        errs = _compare(ref, x, grid, step)
                        bad = {k: v for k, v in errs.items() if not v <= tol}
                        if bad:
                            fails.append(f"{name} {parts} {dtype} step {step}: {bad}")
                    ref.eval()
                    x = torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(9), dtype=dtype)
                    errs = _compare(ref, x, grid, 9)
                    if not errs["out"] <= tol:
                        fails.append(f"{name} {parts} {dtype} eval: {errs}")
    assert state().gathers == 0
    return fails


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_norms_equal_serial(dtype):
    for fails in run_in_processes(_norms, 2, [dtype], timeout_s=300):
        assert not fails, "\n".join(fails)


def test_norms_equal_serial_2x2():
    """4 ranks, uneven tiles in both dimensions (float64: the algorithm, not the summation order)."""
    for fails in run_in_processes(_norms, 4, [torch.float64], "", [(2, 2)], timeout_s=600, collective_timeout_s=300):
        assert not fails, "\n".join(fails)


@pytest.mark.parametrize("sabotage", ["local_statistics", "local_backward"])
def test_norm_check_detects_tile_local_statistics(sabotage):
    """The comparison above fails when the statistics (or their gradient sums) are not aggregated."""
    for fails in run_in_processes(_norms, 2, [torch.float64], sabotage, timeout_s=300):
        for name in _layers():
            assert any(f.startswith(name + " ") for f in fails), f"{sabotage}: {name} not caught"


def _bf16(rank: int, world: int) -> list[str]:
    """bf16 autocast: the result has the serial op's dtype and is close to it; backward runs."""
    fails: list[str] = []
    grid = create_hybrid_layout((2, 1)).grid
    x = torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(1))
    for name, layer in _layers().items():
        ref = _init(layer, torch.float32)
        sp = copy.deepcopy(ref)
        with torch.autocast("cpu", dtype=torch.bfloat16), on_unsupported("error"):
            yr = ref(x.bfloat16())
            xt = tile_of(x, grid).bfloat16().requires_grad_(True)
            ys = sp(split_tensor(xt, grid, x.shape))
            ys.float().sum().backward()
        if ys.dtype != yr.dtype:
            fails.append(f"{name}: dtype {ys.dtype} != serial {yr.dtype}")
        err = max_err(ys.full().float(), yr.float())
        if not err <= 5e-2 or xt.grad is None or not torch.isfinite(xt.grad).all():
            fails.append(f"{name}: bf16 error {err}")
    return fails


def test_norms_bf16_autocast():
    for fails in run_in_processes(_bf16, 2, timeout_s=300):
        assert not fails, "\n".join(fails)


# ------------------------------------------------------------------------------------------------------------
# through Trainer.fit: a user model with the three normalisations equals one process, with nothing gathered
# ------------------------------------------------------------------------------------------------------------
class NormNet(nn.Module):
    """GroupNorm, InstanceNorm2d (affine, running statistics) and LayerNorm([C, H, W]) between convolutions."""

    def __init__(self) -> None:
        from tests.spatial.lightning.test_split_equals_one_process import CLASSES
        from tests.spatial.lightning.test_split_equals_one_process import C as CIN
        from tests.spatial.lightning.test_split_equals_one_process import H as HT
        from tests.spatial.lightning.test_split_equals_one_process import W as WT

        super().__init__()
        self.conv1 = nn.Conv2d(CIN, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.ln = nn.LayerNorm([6, HT, WT])
        self.out = nn.Conv2d(6, CLASSES, 1)

    def forward(self, x):
        f = torch.relu(self.gn(self.conv1(x)))
        f = torch.relu(self.inorm(self.conv2(f)))
        return self.out(self.ln(f))


def _one_process_run(make=NormNet, target: str = "seg") -> dict:
    """One process's run of ``make()`` on the conformance data, with the segmentation or the class targets."""
    from tests.spatial.lightning.test_split_equals_one_process import BATCH, compute_loss, make_data

    x, seg, cls = make_data()
    torch.manual_seed(0)
    return serial_sgd_fit(make(), x, seg if target == "seg" else cls, compute_loss, BATCH)


def _split_run(rank: int, world: int, parts, make=NormNet, target: str = "seg") -> dict:
    """``make()`` trained by ``Trainer.fit`` split into ``parts``, then its eval output on the tiled input (whole)."""
    from lightning_hpc.spatial.layout.tiling import tile_slices
    from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
    from tests.fit_harness import fit
    from tests.spatial.lightning.test_split_equals_one_process import TileData, UserModule, make_data

    x, seg, cls = make_data()
    torch.manual_seed(0)
    module = UserModule(make())
    strategy = SpatialParallelStrategy(spatial_parts=parts)
    run = fit(module, datamodule=TileData(x, seg if target == "seg" else cls), devices=world, strategy=strategy,
              max_steps=3, max_epochs=1, use_distributed_sampler=False, record_warnings=True,
              params=lambda m: m.model.parameters())
    grid = strategy.layout.grid
    module.eval()
    rs, cs = tile_slices((x.shape[-2], x.shape[-1]), parts, grid.index)
    with torch.no_grad():
        out = module.model(split_tensor(x[..., rs, cs].contiguous(), grid, x.shape))
        out = out.full() if hasattr(out, "full") else out  # a classifier's output is replicated
    return {"loss": run.metric("train_loss"), "grads": module.first_grads, "params": run.params,
            "buffers": [b.clone() for b in module.model.buffers()], "out": out.clone(), "gathers": state().gathers,
            "warnings": run.warned("spatial:")}


def _check_fit(res: dict, ref: dict, what: str, tol: float = 1e-5) -> None:
    assert not res["warnings"], f"{what}: {res['warnings']}"  # nothing gathered, so nothing to warn about
    assert res["gathers"] == 0, what
    assert abs(res["loss"] - ref["loss"]) <= tol * max(1.0, abs(ref["loss"])), (what, res["loss"], ref["loss"])
    for kind in ("grads", "params", "buffers"):
        assert len(res[kind]) == len(ref[kind]), (what, kind)
        for k, (a, b) in enumerate(zip(res[kind], ref[kind])):
            assert max_err(a, b) <= tol, f"{what}: {kind} {k} differs by {max_err(a, b)}"
    assert max_err(res["out"], ref["out"]) <= tol, f"{what}: outputs differ by {max_err(res['out'], ref['out'])}"


@pytest.mark.parametrize("parts", PARTS, ids=["2x1", "1x2"])
def test_trainer_fit_with_norms_equals_one_process(parts):
    ref = _one_process_run()
    for res in run_in_processes(_split_run, 2, parts, timeout_s=300, collective_timeout_s=120):
        _check_fit(res, ref, f"{parts[0]}x{parts[1]}")


@pytest.mark.slow
def test_trainer_fit_with_norms_equals_one_process_2x2():
    ref = _one_process_run()
    for res in run_in_processes(_split_run, 4, (2, 2), timeout_s=900, collective_timeout_s=300):
        _check_fit(res, ref, "2x2", tol=5e-5)

"""Every strategy with ``devices=1`` on the GPU, K-FAC in float32, bf16-mixed and 16-mixed, and a checkpoint saved
on the GPU resumed on the CPU: the conformance cases (``tests/conformance/run_case.py``) run on the device and on
the CPU, each run's final parameters compared.

Tolerances: float64 cells agree to 1e-9 of the parameters' scale (summation order and cuBLAS / cuSOLVER against
the CPU's BLAS / LAPACK); float32 cells to 1e-5 (TF32 is off in the cases); a mixed-precision cell may differ from
its device's float32 run by at most 4x what the same precision costs on the CPU (largest parameter difference
against the CPU's float32 run), and every step it took must be finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DEVICE, largest_difference, load_conformance

launch = load_conformance("launch")

#: (strategy, case): float64 cells, exact against the CPU
EXACT64 = [
    ("ddp", "sgd"),
    ("layered_sgd", "sgd"),
    ("hybrid_fc", "sgd"),
    ("spatial_1x1", "sgd"),
    ("multigrid_pm", "odenet"),
    ("multigrid", "odenet"),
    ("kfac_ddp", "sgd"),
    ("kfac_ddp", "adamw"),
    ("kfac_layered_sgd", "sgd"),
]
#: float32 cells (K-FAC's float32 run is the yardstick of the mixed-precision cells)
EXACT32 = [("ddp", "fp32_for_bf16"), ("kfac_ddp", "fp32_for_bf16")]
#: reduced precision: case -> its float32 yardstick case
MIXED = {("kfac_ddp", "bf16_mixed"): "fp32_for_bf16", ("kfac_ddp", "kfac_fp16_plugin"): "fp32_for_bf16"}
#: fit one epoch, checkpoint, fit a second from it: saved on the device, resumed on the CPU
RESUMED = [("ddp", "resume"), ("kfac_ddp", "resume"), ("hybrid_fc", "resume"), ("multigrid_pm", "odenet_resume")]
ITEMS = [f"{s}:{c}" for s, c in [*EXACT64, *EXACT32, *MIXED, *RESUMED]]


class Runs:
    """One launch per device for every item (cases run one after another in one process)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs: dict[str, str] = {}

    def run(self, where: str) -> tuple[Path, str]:
        out = self.root / where
        if where not in self.logs:
            accelerator = DEVICE if where == "device" else "cpu"
            self.logs[where] = launch.launch(1, out, ITEMS, data_parallel=2, log_name=f"{where}.log",
                                             env_extra={"CONFORMANCE_ACCELERATOR": accelerator}, processes=1)
        return out, self.logs[where]

    def resumed_on_cpu(self) -> tuple[Path, str]:
        """The second half of each resumable case on the CPU, from the device run's first-epoch checkpoint."""
        out = self.root / "resumed"
        if "resumed" not in self.logs:
            device_out, _ = self.run("device")
            items = [f"{s}:{c}_2_to_1" for s, c in RESUMED]
            self.logs["resumed"] = launch.launch(1, out, items, data_parallel=2, log_name="resumed.log",
                                                 env_extra={"CONFORMANCE_RESUME_FROM": str(device_out)}, processes=1)
        return out, self.logs["resumed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("gpu_cells"))


def result(runs: Runs, where: str, strategy: str, case: str) -> Any:
    out, log = runs.resumed_on_cpu() if where == "resumed" else runs.run(where)
    res = launch.read(out, strategy, case, log, world=1)
    assert res.error is None, f"{strategy}:{case} on {where} raised:\n{res.error}"
    return res


@pytest.mark.parametrize("strategy,case", EXACT64, ids=[f"{s}:{c}" for s, c in EXACT64])
def test_float64_cell_on_device_equals_cpu(runs: Runs, strategy: str, case: str) -> None:
    dev, cpu = result(runs, "device", strategy, case), result(runs, "cpu", strategy, case)
    assert dev.ranks[0]["steps"] == cpu.ranks[0]["steps"] > 0
    diff, scale = largest_difference(dev.params(), cpu.params())
    assert diff <= 1e-9 * max(scale, 1.0), f"{strategy}:{case}: {DEVICE} vs cpu differ by {diff:.3e}"


@pytest.mark.parametrize("strategy,case", EXACT32, ids=[f"{s}:{c}" for s, c in EXACT32])
def test_float32_cell_on_device_equals_cpu(runs: Runs, strategy: str, case: str) -> None:
    dev, cpu = result(runs, "device", strategy, case), result(runs, "cpu", strategy, case)
    diff, scale = largest_difference(dev.params(), cpu.params())
    assert diff <= 1e-5 * max(scale, 1.0), f"{strategy}:{case}: {DEVICE} vs cpu differ by {diff:.3e}"


@pytest.mark.parametrize("strategy,case", list(MIXED), ids=[f"{s}:{c}" for s, c in MIXED])
def test_mixed_precision_on_device_is_bounded(runs: Runs, strategy: str, case: str) -> None:
    yardstick = MIXED[(strategy, case)]
    dev, dev32 = result(runs, "device", strategy, case), result(runs, "device", strategy, yardstick)
    cpu, cpu32 = result(runs, "cpu", strategy, case), result(runs, "cpu", strategy, yardstick)
    assert dev.ranks[0]["steps"] == cpu.ranks[0]["steps"] > 0
    params = dev.params()
    assert all(bool(torch.isfinite(v).all()) for v in params.values())
    on_device, _ = largest_difference(params, dev32.params())
    on_cpu, _ = largest_difference(cpu.params(), cpu32.params())
    assert on_cpu > 0, "the CPU's mixed-precision run equals its float32 run: the bound would measure nothing"
    assert on_device <= 4 * on_cpu, f"{strategy}:{case}: {on_device:.3e} from float32 on {DEVICE}, {on_cpu:.3e} on cpu"


@pytest.mark.parametrize("strategy,case", RESUMED, ids=[f"{s}:{c}" for s, c in RESUMED])
def test_checkpoint_saved_on_device_resumes_on_cpu(runs: Runs, strategy: str, case: str) -> None:
    uninterrupted = result(runs, "device", strategy, case)
    resumed = result(runs, "resumed", strategy, f"{case}_2_to_1")
    cpu = result(runs, "cpu", strategy, case)
    assert resumed.ranks[0]["global_step"] == uninterrupted.ranks[0]["global_step"]
    diff, scale = largest_difference(resumed.params(), uninterrupted.params())
    assert diff <= 1e-9 * max(scale, 1.0), f"{strategy}:{case} resumed on cpu vs {DEVICE}: {diff:.3e}"
    diff, scale = largest_difference(resumed.params(), cpu.params())
    assert diff <= 1e-9 * max(scale, 1.0), f"{strategy}:{case} resumed on cpu vs all on cpu: {diff:.3e}"

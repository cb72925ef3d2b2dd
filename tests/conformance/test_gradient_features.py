"""Users' modules with gradient features under our strategies, through ``Trainer.fit`` on 2 processes: the final
parameters equal one process on the global batch (float64, 1e-9), or the strategy refuses before training.

Cells (strategy x feature): gradient clipping by norm and by value, manual optimization with
``self.clip_gradients`` between ``manual_backward`` and ``step``, a network split into ``self.backbone`` +
``self.classifier`` (DDP cells check the harness itself); and modules a strategy must refuse before training,
with the fix named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "run_case.py"
STEPS = 4  # run_case.STEPS
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def run(case: str, strategy: str, devices: int, out: Path, data_parallel: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), case, strategy, str(devices), str(out), str(data_parallel)],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=300,
    )


def params(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(case: str, data_parallel: int) -> dict[str, torch.Tensor]:
        key = f"{case}_dp{data_parallel}"
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref_{key}") / "final.ckpt"
            proc = run(case, "auto", 1, out, data_parallel)
            assert proc.returncode == 0, proc.stderr[-4000:]
            cache[key] = params(out)
        return cache[key]

    return get


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == ref.keys(), what
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-9, f"{what}: final parameters differ from one process by {worst:.3g}"


CELLS = [
    ("layered_sgd", "clip_norm"),
    ("ddp", "clip_norm"),  # the harness itself: DDP is exact here
    ("hybrid_fc", "clip_norm"),
    ("hybrid_fc", "clip_value"),
    ("layered_sgd", "manual_clip"),
    ("ddp", "manual_clip"),
    ("hybrid_fc", "backbone_classifier"),
    ("hybrid_fc", "adamw"),
    ("layered_sgd", "adamw"),
    ("hybrid_fc", "accumulate_2"),
    ("layered_sgd", "accumulate_2"),
    ("hybrid_fc_find_unused", "unused_parameter"),  # the fix the error message names
    ("multigrid_pm", "odenet"),  # the trunk's steps are split over the 2 ranks; both see the same samples
    ("multigrid_pm", "odenet_clip_norm"),
]

#: data-parallel ranks of each strategy on 2 processes (the reference's global batch is the union of theirs)
DATA_PARALLEL = {"multigrid_pm": 1}

REFUSED = [
    # Lightning's BoringModel is one nn.Linear: no data-parallel trunk for hybrid_fc to pair with its head
    ("hybrid_fc", "boring_model", r"searched the layers of BoringModel.*found none.*strategy='ddp'"),
    # Flatten + Linear: the head is found, but nothing before it trains
    ("hybrid_fc", "flatten_linear", r"no trainable parameter outside the fully-connected head.*strategy='ddp'"),
    # Lightning's predict sampler gives ranks unequal batches; the sharded head needs every rank in each batch
    ("hybrid_fc", "predict", r"cannot run trainer.predict on several processes.*Trainer\(devices=1\)"),
    # autocast does not reach multigrid's batched (vmapped) steps: it crashed with a dtype mismatch
    ("multigrid", "odenet_bf16_mixed", r"mode='mg' does not support precision='bf16-mixed'.*'32-true'.*mode='pm'"),
]


@pytest.mark.parametrize(("strategy", "case"), CELLS, ids=[f"{s}-{c}" for s, c in CELLS])
def test_two_processes_equal_one(strategy, case, reference, tmp_path):
    out = tmp_path / "final.ckpt"
    proc = run(case, strategy, 2, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"OPTIMIZER STEP {STEPS - 1} on rank 1" in proc.stdout, "the second rank did not train"
    assert_same(params(out), reference(case, DATA_PARALLEL.get(strategy, 2)), f"{strategy} x {case}")


@pytest.mark.parametrize(("strategy", "case", "message"), REFUSED, ids=[f"{s}-{c}" for s, c, _ in REFUSED])
def test_refused_before_training_with_the_fix_named(strategy, case, message, tmp_path):
    import re

    out = tmp_path / "final.ckpt"
    proc = run(case, strategy, 2, out)
    assert proc.returncode != 0, "expected a refusal"
    assert re.search(message, proc.stderr, re.S), proc.stderr[-3000:]
    assert "OPTIMIZER STEP" not in proc.stdout and not out.exists(), "the refusal came after training started"


def test_unused_parameter_error_names_this_strategys_fix(tmp_path):
    proc = run("unused_parameter", "hybrid_fc", 2, tmp_path / "final.ckpt")
    assert proc.returncode != 0
    assert "HybridParallelStrategy(find_unused_parameters=True)" in proc.stderr, proc.stderr[-3000:]

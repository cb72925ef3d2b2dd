"""``bench/gpu_figures.py --smoke``: the GPU figures' script runs end to end on the CPU at toy sizes (every figure:
K-FAC beside kfac-pytorch where it is installed, K-FAC's parts, multigrid, the spatial dispatch with its protocol
floor and the compiled split step), so the script a GPU machine runs, with little time on it, fails there only for
what needs the GPU. No figure may end in an error, and each carries the fields its report reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _errors(node, path="") -> list[str]:
    if isinstance(node, dict):
        return [f"{path}: {node['error'].strip().splitlines()[-1]}"] if "error" in node else \
            [e for k, v in node.items() for e in _errors(v, f"{path}/{k}")]
    if isinstance(node, list):
        return [e for i, v in enumerate(node) for e in _errors(v, f"{path}[{i}]")]
    return []


@pytest.mark.slow
def test_gpu_figures_run_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_figures.py"), "--smoke", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert _errors(figures) == []
    assert figures["device"].startswith("cpu (--smoke")
    assert len(figures["kfac"]) == len(figures["kfac_parts"]) == 4
    for row in figures["kfac"]:
        assert row["kfac_vs_sgd"] > 0 and ("kfac_pytorch_vs_sgd" in row or "kfac_pytorch" in row), row
    for row in figures["kfac_parts"]:
        assert row["amortized_f10_d100_vs_sgd"] > 0 and row["layers_preconditioned"] > 0, row
    assert figures["multigrid"] and all(r["mg_batched_vs_serial"] > 0 for r in figures["multigrid"])
    spatial = figures["spatial"]
    for key in ("dispatch_overhead", "protocol_floor_overhead", "compiled_split_vs_compiled_plain",
                "dispatch_vs_compiled_plain"):
        assert isinstance(spatial[key], float), (key, spatial)

"""Launch-level behaviour: a recipe with ``strategy=horovod`` under horovodrun, and devices/num_nodes checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hvd_launch import REPO, horovodrun_command, requires_horovod, run_checked, worker_env

pytestmark = [pytest.mark.horovod, requires_horovod]


def test_digits_recipe_fast_dev_run_under_horovodrun(tmp_path):
    out = run_checked(
        [
            *horovodrun_command(2), sys.executable, "-m", "lightning_hpc", "train", "recipe=digits",
            "strategy=horovod", "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}",
        ],
        timeout_s=300,
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 1, out.stdout[-3000:]  # fast_dev_run: one optimizer step
    assert "[1]<" in out.stdout, "horovodrun did not run a second rank"
    assert "_target_: lightning_hpc.HorovodStrategy" in (tmp_path / ".hydra" / "config.yaml").read_text()


def test_devices_and_num_nodes_must_match_the_launch():
    # a plain `python` process is a Horovod world of size 1 (one process, one node); one subprocess, two checks
    code = (
        "import lightning.pytorch as pl, lightning_hpc\n"
        "for kwargs in ({'devices': 2}, {'num_nodes': 2}):\n"
        "    try:\n"
        "        pl.Trainer(strategy='horovod', accelerator='cpu', logger=False, **kwargs)\n"
        "        print('NO ERROR', kwargs)\n"
        "    except ValueError as err:\n"
        "        print('ERROR:', err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NO ERROR" not in out.stdout, out.stdout
    assert "devices=2 but Horovod started 1 process(es) on this node" in out.stdout, out.stdout
    assert "num_nodes=2 but Horovod runs on 1 node(s)" in out.stdout, out.stdout
    assert out.stdout.count("horovodrun -np") == 2

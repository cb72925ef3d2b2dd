"""Launch-level behaviour: a recipe with ``strategy=horovod`` under horovodrun, and devices/num_nodes checks (both
cases of the shared 2-process launch, conftest.py)."""

from __future__ import annotations

import json

import pytest
from hvd_launch import requires_horovod

pytestmark = [pytest.mark.horovod, requires_horovod]


def test_digits_recipe_fast_dev_run_under_horovodrun(two_ranks):
    """``lightning-hpc train recipe=digits strategy=horovod`` on every rank of the shared 2-process launch."""
    run = two_ranks.case_dir("digits_recipe")
    out = two_ranks.finish()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 1, out[-3000:]  # fast_dev_run: one optimizer step
    assert "[1]<stdout>:CASE digits_recipe DONE on rank 1" in out, "horovodrun did not run the recipe on a second rank"
    assert "_target_: lightning_hpc.HorovodStrategy" in (run / ".hydra" / "config.yaml").read_text()


def test_devices_and_num_nodes_must_match_the_launch(two_ranks):
    # Trainer(strategy="horovod") with devices=3, then num_nodes=2, on each rank of a 2-process launch on one node
    for rank in two_ranks.ranks("launch_checks"):
        assert rank["local_size"] == 2
        errors = rank["errors"]
        assert errors["devices"] is not None and errors["num_nodes"] is not None, errors
        assert "devices=3 but Horovod started 2 process(es) on this node" in errors["devices"], errors
        assert "num_nodes=2 but Horovod runs on 1 node(s)" in errors["num_nodes"], errors
        assert all("horovodrun -np" in err for err in errors.values()), errors

"""Placement policies: the SC20 round-robin rule, K-FAC-lw, and the balanced (LPT) bound."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_hpc.cli.plan_kfac import model_factor_dims
from lightning_hpc.kfac.placement import assign_factors, placement_summary


def test_round_robin_fewer_ranks_than_layers_keeps_a_and_g_together():
    dims = [(10, 3)] * 5
    got = assign_factors(dims, 3, "round_robin")
    assert [got[(i, "A")] for i in range(5)] == [0, 1, 2, 0, 1]
    assert all(got[(i, "G")] == got[(i, "A")] for i in range(5))


def test_round_robin_more_ranks_than_layers_spreads_g_to_the_next_rank():
    dims = [(10, 3)] * 3
    got = assign_factors(dims, 4, "round_robin")
    assert [(got[(i, "A")], got[(i, "G")]) for i in range(3)] == [(0, 1), (2, 3), (0, 1)]


def test_layer_wise_puts_both_factors_of_a_layer_on_one_rank():
    got = assign_factors([(5, 5)] * 7, 3, "layer_wise")
    assert [got[(i, "A")] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert all(got[(i, "G")] == got[(i, "A")] for i in range(7))


@pytest.mark.parametrize("model", ["resnet50", "resnet101", "resnet152"])
@pytest.mark.parametrize("world", [16, 32, 64])
def test_balanced_within_5_percent_of_lower_bound_on_resnets(model, world):
    _, dims = model_factor_dims(model)
    s = placement_summary(dims, world, assign_factors(dims, world, "balanced"))
    assert s["max_cost"] <= 1.05 * s["lower_bound_cost"], s["max_over_lower_bound"]
    rr = placement_summary(dims, world, assign_factors(dims, world, "round_robin"))
    assert s["max_cost"] <= rr["max_cost"]


def _optimum(costs: list[int], world: int) -> int:
    best = sum(costs)
    for assignment in itertools.product(range(world), repeat=len(costs)):
        loads = [0] * world
        for c, r in zip(costs, assignment):
            loads[r] += c
        best = min(best, max(loads))
    return best


def test_balanced_is_lpt_within_its_worst_case_bound_of_the_true_optimum():
    # Where the lower bound itself is unreachable (few equal large factors, e.g. cifar_resnet32 on 8 ranks) the
    # 5% figure cannot hold for any placement; LPT's guarantee is 4/3 - 1/(3 world) of the optimum.
    rng = random.Random(0)
    for _ in range(30):
        world = rng.choice([2, 3])
        dims = [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(rng.randint(2, 4))]
        s = placement_summary(dims, world, assign_factors(dims, world, "balanced"))
        costs = [n**3 for d in dims for n in d]
        assert s["max_cost"] <= (4 / 3 - 1 / (3 * world)) * _optimum(costs, world) + 1e-9


def test_summary_counts_every_factor_once():
    dims = [(4, 2), (3, 3)]
    s = placement_summary(dims, 2, assign_factors(dims, 2, "balanced"))
    assert sum(r["numel"] for r in s["ranks"]) == 16 + 4 + 9 + 9
    assert s["total_cost"] == 64 + 8 + 27 + 27 and s["lower_bound_cost"] == 64


def test_bad_placement_and_world():
    with pytest.raises(ValueError, match="placement"):
        assign_factors([(2, 2)], 2, "random")
    with pytest.raises(ValueError, match="world_size"):
        assign_factors([(2, 2)], 0, "balanced")


def test_core_modules_do_not_import_lightning():
    import ast
    from pathlib import Path

    import lightning_hpc.kfac as pkg

    core = [p for p in Path(pkg.__file__).parent.glob("*.py") if p.name not in ("callback.py", "precision.py")]
    assert len(core) >= 6
    for path in core:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), (
                f"{path.name} imports {names}"
            )

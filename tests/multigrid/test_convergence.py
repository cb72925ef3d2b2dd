"""Fig. 4 property: the residual reaches 1e-9 in about the same number of cycles whatever the depth."""

import pytest
import torch
from mg_helpers import make_net, options

from lightning_hpc.multigrid import MultigridODEBlock


def cycles_to(tol: float, num_steps: int, levels: int, cfactor: int, relaxation: str) -> tuple[int, list[float]]:
    net, x = make_net(num_steps)  # h = T / N with T fixed: deeper = finer discretisation of the same ODE
    block = MultigridODEBlock(net.steps, options(levels, cfactor, 40, relaxation, tol=tol))
    with torch.no_grad():
        block(net.opening(x))
    history = block.forward_history
    assert history[-1] <= tol, f"{num_steps} steps did not reach {tol} in 40 cycles: {history}"
    return len(history), history


@pytest.mark.parametrize("levels,cfactor,relaxation", [(2, 4, "F"), (3, 2, "FCF")])
def test_cycles_to_tolerance_independent_of_depth(levels, cfactor, relaxation, capsys):
    counts = {n: cycles_to(1e-9, n, levels, cfactor, relaxation)[0] for n in (32, 64, 128, 256)}
    with capsys.disabled():
        print(f"\ncycles to ||R_h|| <= 1e-9 ({levels} levels, c={cfactor}, {relaxation}): {counts}")
    # 8x more layers, at most one more cycle (a method whose cost grew with depth would need ~N/c cycles)
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    # far fewer than the N/c cycles after which two-level F-relaxation is exact by mere propagation
    assert counts[256] <= 12 < 256 // cfactor // 2, counts


def test_residual_decreases_every_cycle():
    _, history = cycles_to(1e-9, 64, 3, 2, "FCF")
    assert all(b < a for a, b in zip(history, history[1:])), history

"""The performance model counts the work the solver does."""

import pytest

from lightning_hpc.multigrid.cost import multigrid_pass_time, partitioned_step_time
from lightning_hpc.perfmodel import AlphaBeta

FREE = AlphaBeta(0.0, 0.0)


def count_layer_evaluations(num_steps, cfactor, levels, cycles, relaxation):
    """Instrumented solve: how many single-layer evaluations the implementation performs."""
    from mg_helpers import make_net, options

    from lightning_hpc.multigrid import MultigridODEBlock

    net, x = make_net(num_steps)
    block = MultigridODEBlock(net.steps, options(levels, cfactor, cycles, relaxation))
    count = [0]
    original = block.solver.stack.step

    def counting(layers, h, u):
        count[0] += u.shape[0]
        return original(layers, h, u)

    block.solver.stack.step = counting
    block(net.opening(x).detach().requires_grad_())  # grad: all points needed (closing F-relaxation kept)
    return count[0]


@pytest.mark.parametrize("levels,cfactor,relaxation,cycles", [(2, 4, "F", 2), (3, 2, "FCF", 2), (3, 4, "F", 3)])
def test_model_counts_what_the_solver_evaluates(levels, cfactor, relaxation, cycles):
    n = 64
    predicted = multigrid_pass_time([1.0] * n, 1, cfactor, levels, cycles, relaxation, 0, FREE).compute
    assert predicted == count_layer_evaluations(n, cfactor, levels, cycles, relaxation)


def test_parallel_compute_shrinks_with_devices_and_pm_does_not():
    times = [1.0] * 256
    one = multigrid_pass_time(times, 1, 4, 3, 2, "F", 0, FREE).compute
    four = multigrid_pass_time(times, 4, 4, 3, 2, "F", 0, FREE).compute
    assert four < one / 3
    pm = [partitioned_step_time(times, times, p, 0, FREE)["step"] for p in (1, 4)]
    assert pm[0] == pm[1] == 512

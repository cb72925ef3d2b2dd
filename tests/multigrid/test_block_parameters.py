"""The layer-sharded trunk's step parameters as user code sees them (2 processes, float64): a gradient norm and
an L2 penalty summed over the local steps' parameters equal one process's over all steps, and the penalty's
gradient reaches each local step as on one process; a branch shared by the steps, and shares whose steps hold
different parameters, are refused when the trunk is split."""

import pytest
import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models.ode_resnet import ResidualStep
from lightning_hpc.multigrid.sharded import LayerShardedTrunk

STEPS = 4


def _steps(shared: bool = False, bias_from: int = STEPS) -> nn.Sequential:
    torch.manual_seed(0)
    branches = [nn.Linear(3, 3, bias=i < bias_from).double() for i in range(STEPS)]
    if shared:
        branches = [branches[0]] * STEPS
    return nn.Sequential(*[ResidualStep(b, 0.25) for b in branches])


def _loss(trunk: nn.Module) -> torch.Tensor:
    x = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    return trunk(x).pow(2).sum()


def _observe(module: nn.Module) -> dict:
    """What user code sees: the gradient norm over ``module.parameters()``, an L2 penalty over them and the
    penalty's gradient of each parameter (by name)."""
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))
    penalty = sum(p.pow(2).sum() for p in module.parameters())
    for p in module.parameters():
        p.grad = None
    penalty.backward()
    return {"norm": float(norm), "penalty": float(penalty.detach()),
            "grads": {n: p.grad.clone() for n, p in module.named_parameters()}}


def _one_process() -> dict:
    steps = _steps()
    _loss(steps).backward()
    return _observe(steps)


def _ranks(rank: int, world: int, case: str) -> dict:
    if case != "plain":
        with pytest.raises(ValueError, match=case):
            shared = "share" in case
            LayerShardedTrunk(_steps(shared, bias_from=STEPS if shared else 2), torch.distributed.group.WORLD, 2, 1)
        return {}
    full = _steps()
    trunk = LayerShardedTrunk(full, torch.distributed.group.WORLD, 2, 1)
    # the serial loss through this rank's steps: the chain's own forward is the strategy's; the reductions are
    # what is tested here, so each rank takes its steps' gradients from the serial model
    _loss(full).backward()
    local = dict(trunk.named_parameters())
    for name, p in local.items():
        p.grad = dict(full.named_parameters())[name].grad.clone()
    return _observe(trunk)


def test_norm_and_penalty_over_the_local_steps_are_the_whole_trunks():
    ref = _one_process()
    for got in run_in_processes(_ranks, 2, "plain"):
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-13)
        assert got["penalty"] == pytest.approx(ref["penalty"], rel=1e-13)
        for name, grad in got["grads"].items():
            assert torch.allclose(grad, ref["grads"][name], rtol=0, atol=1e-15), name


@pytest.mark.parametrize("case", [r"steps '0' and '1' of the trunk share one parameter.*copy.deepcopy",
                                  r"ranks hold steps with different parameters.*same layers"])
def test_refused_when_split(case):
    run_in_processes(_ranks, 2, case)

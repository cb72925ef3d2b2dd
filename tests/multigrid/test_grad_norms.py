"""Per-parameter gradient norms with the trunk split over layer ranks: ``lightning_hpc.multigrid.grad_norm`` logs
what one process's ``lightning.pytorch.utilities.grad_norm`` logs (an entry for every parameter of the whole
model under its serial name, every residual step's own norm, and the total), and Lightning's own ``grad_norm``,
whose entries would name this rank's steps with the norms of their place in every rank's share, is refused
before the first optimizer step naming that function."""

from __future__ import annotations

import pytest
import torch
from mg_lightning_workers import multigrid_grad_norms, serial_grad_norms, user_odenet

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.multigrid import grad_norm

STEPS = 2


def test_grad_norm_of_a_split_trunk_equals_one_processs_lightning_grad_norm():
    out = run_in_processes(multigrid_grad_norms, 2, False, STEPS, timeout_s=400, collective_timeout_s=120)
    reference = serial_grad_norms(STEPS)
    names = [n for n, _ in user_odenet().named_parameters()]
    assert len(reference[0]) == len(names) + 1  # every parameter of the serial model, and the total
    for rank, o in enumerate(out):
        assert "error" not in o, o.get("error")
        assert len(o["recorded"]) == STEPS, rank
        for step, (got, expected) in enumerate(zip(o["recorded"], reference)):
            assert list(got) == list(expected), (rank, step)  # the same keys in the serial model's order
            for key, value in expected.items():
                assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), (rank, step, key, got[key], value)


def test_lightning_grad_norm_of_a_split_trunk_is_refused_before_the_first_step_naming_the_fix():
    out = run_in_processes(multigrid_grad_norms, 2, True, STEPS, timeout_s=400, collective_timeout_s=120)
    for rank, o in enumerate(out):
        assert "lightning_hpc.multigrid.grad_norm" in o.get("error", ""), (rank, o)
        assert o["global_step"] == 0 and o["changed"] == [], (rank, o)


def test_grad_norm_of_an_unsplit_model_is_lightnings():
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    model = user_odenet()
    model(torch.randn(4, 1, 8, 8, dtype=torch.float64)).square().sum().backward()
    for norm_type in (1, 2.0, "inf"):
        ours, theirs = grad_norm(model, norm_type), lightning_grad_norm(model, norm_type)
        assert list(ours) == list(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with pytest.raises(ValueError, match="must be a positive number"):
        grad_norm(model, 0)


FROZEN = ("steps.2.branch.0.bias", "steps.13.branch.0.weight")  # one on each layer rank's half of the trunk


def _split_trunk_norms(rank, world_size):
    import copy

    import torch.distributed as dist
    from mg_helpers import make_net

    from lightning_hpc.multigrid import PartitionedODEBlock

    net, x = make_net(16)
    for name in FROZEN:
        net.get_parameter(name).requires_grad_(False)
    net = copy.deepcopy(net)
    net.steps = PartitionedODEBlock(net.steps, group=dist.group.WORLD)
    net(x).square().sum().backward()
    return {k: float(v) for k, v in grad_norm(net, 2).items()}


def test_grad_norm_of_a_split_trunk_leaves_out_frozen_parameters_as_lightning_does():
    """Parameters without a gradient (frozen) have no entry in Lightning's ``grad_norm``: none either for the
    residual steps held by another layer rank."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
    from mg_helpers import make_net

    net, x = make_net(16)
    for name in FROZEN:
        net.get_parameter(name).requires_grad_(False)
    net(x).square().sum().backward()
    reference = {k: float(v) for k, v in lightning_grad_norm(net, 2).items()}
    assert not any(name in key for key in reference for name in FROZEN)
    for rank, got in enumerate(run_in_processes(_split_trunk_norms, 2)):
        assert list(got) == list(reference), rank
        for key, value in reference.items():
            assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), (rank, key, got[key], value)

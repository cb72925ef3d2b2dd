"""``spread_decompositions``: each factor decomposed at a step of its own within ``inv_update_freq``
(``schedules.spread_phases``), against a reference schedule written here from the definition (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.options import KFACOptions
from lightning_hpc.kfac.schedules import spread_phases

F64 = torch.float64


@pytest.mark.parametrize("interval", [1, 3, 4, 10])
def test_spread_phases_partition_and_balance(interval):
    """Every item gets one phase in the interval; the phases' loads differ by at most the largest item (longest
    first onto the lightest phase), and equal items are spread round the interval."""
    costs = [512, 27, 8, 1000, 343, 64, 64, 1, 125, 216]
    phases = spread_phases(costs, interval)
    assert len(phases) == len(costs) and all(0 <= p < interval for p in phases)
    loads = [sum(c for c, p in zip(costs, phases) if p == q) for q in range(interval)]
    assert max(loads) - min(loads) <= max(costs)
    assert spread_phases([5] * 6, 3) == [0, 1, 2, 0, 1, 2]


def _run(model: nn.Module, batches, spread: bool, interval: int):
    """Train with lr 0 (every step's gradients and factors depend on its batch only); per step: the raw gradient
    matrices, the running factors after the step's update and the preconditioned gradients."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=interval, damping=0.01,
                             kl_clip=None, decomposition_dtype="float64", factor_dtype="float64",
                             spread_decompositions=spread)  # fmt: skip
    steps = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {h.name: h.grad_matrix().clone() for h in pre.handlers}
        pre.step()
        factors = {h.name: {k: f.clone() for k, f in h.factors.items()} for h in pre.handlers}
        steps.append((raw, factors, {h.name: h.grad_matrix().clone() for h in pre.handlers}))
        opt.step()
    return pre, steps


def _reference(pre: KFACPreconditioner, steps, due) -> list[dict[str, torch.Tensor]]:
    """Eq 13-15 from eigenpairs of the factors as they were at the last step ``s`` with ``due(s, i, kind)``."""
    kept: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for s, (raw, factors, _) in enumerate(steps):
        for i, h in enumerate(pre.handlers):
            for kind in ("A", "G"):
                if s == 0 or due(s, i, kind):
                    d, q = torch.linalg.eigh(factors[h.name][kind])
                    kept[(i, kind)] = d.clamp_min(0), q
        precond = {}
        for i, h in enumerate(pre.handlers):
            (da, qa), (dg, qg) = kept[(i, "A")], kept[(i, "G")]
            v = qg.t() @ raw[h.name] @ qa / (dg[:, None] * da[None, :] + pre.damping)
            precond[h.name] = qg @ v @ qa.t()
        out.append(precond)
    return out


def test_spread_decompositions_equal_the_reference_schedule():
    """With spreading, every step's preconditioned gradients equal Eq 13-15 from each factor decomposed at the
    steps of its phase (``spread_phases`` of the factors' ``n^3`` over the interval) and at the first step; without
    it, from all of them at the multiples of the interval; the two schedules differ (the reference tells them
    apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 3)).to(F64)
    batches = [(torch.randn(16, 6, dtype=F64), torch.randint(0, 3, (16,))) for _ in range(9)]
    interval = 4
    pre, spread = _run(model, batches, True, interval)
    items = [(i, kind) for i in range(len(pre.handlers)) for kind in ("A", "G")]
    costs = [pre.handlers[i].factor_forms()[kind].cost for i, kind in items]
    phase = dict(zip(items, spread_phases(costs, interval)))
    assert len(set(phase.values())) == interval  # the decompositions are spread over every step of the interval
    expected = _reference(pre, spread, lambda s, i, kind: s % interval == phase[(i, kind)])
    _, plain = _run(model, batches, False, interval)
    expected_plain = _reference(pre, plain, lambda s, i, kind: s % interval == 0)
    differ = False
    for s in range(len(batches)):
        for name in expected[s]:
            got, want = spread[s][2][name], expected[s][name]
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 1e-10 * scale, (s, name)
            assert float((plain[s][2][name] - expected_plain[s][name]).abs().max()) <= 1e-10 * scale, (s, name)
            differ |= float((expected_plain[s][name] - want).abs().max()) > 1e-6 * scale
    assert differ


def test_spread_decompositions_is_an_option_defaulting_off():
    assert KFACOptions().spread_decompositions is False
    assert KFACOptions(spread_decompositions=True).spread_decompositions is True


def _spread_train(rank: int, world_size: int) -> dict:
    """Six steps of a small CNN with spreading on ``world_size`` gloo ranks (each its share of the global batch),
    every placement: the parameters after them."""
    from kfac_checks import average_gradients_like_ddp

    from lightning_hpc.kfac import PLACEMENTS

    torch.set_num_threads(1)
    out = {}
    for placement in PLACEMENTS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1, groups=6),
                              nn.ReLU(), nn.Flatten(), nn.Linear(6 * 5 * 5, 12), nn.ReLU(), nn.Linear(12, 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=3, damping=0.05,
                                 placement=placement, spread_decompositions=True)  # fmt: skip
        per_rank = 16 // world_size
        for step in range(6):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(16, 2, 5, 5, generator=g), torch.randint(0, 5, (16,), generator=g)
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            opt.zero_grad()
            F.cross_entropy(model(x[sl]), y[sl]).backward()
            if world_size > 1:
                average_gradients_like_ddp(model)
            pre.step()
            opt.step()
        out[placement] = [p.detach().numpy().copy() for p in model.parameters()]
    return out


def test_spread_decompositions_on_two_processes_equal_one():
    """Each rank decomposes its share of the step's phase and broadcasts it (every placement): the parameters
    after six steps equal one process's on the same global batch."""
    from lightning_hpc.distributed import run_in_processes

    ref = _spread_train(0, 1)
    results = run_in_processes(_spread_train, 2, timeout_s=300, collective_timeout_s=120)
    for placement, params in ref.items():
        for rank_result in results:
            for got, want in zip(rank_result[placement], params):
                torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{placement}: {m}")  # noqa: B023

"""2 gloo processes, every placement (and 4 processes with half the ranks as gradient workers, KAISA's
HYBRID-OPT): stopping, checkpointing (rank 0 writes, every rank loads that file, as Lightning does) and resuming
gives parameters bitwise equal to an uninterrupted run (CPU, deterministic)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac import PLACEMENTS, KFACPreconditioner

TOTAL, STOP = 9, 6  # decompositions at steps 0 and 4; the factors updated at step 5 are newer than them
BATCH = 8  # per rank


def _fresh(
    placement: str, method: str, fraction: float | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 5, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 3 * 3, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=4, damping=0.03, kl_clip=0.01,
                             placement=placement, compute_method=method, grad_worker_fraction=fraction)  # fmt: skip
    return model, opt, pre


def _steps(
    rank: int, world: int, model: nn.Module, opt: torch.optim.Optimizer, pre: KFACPreconditioner, steps: range
) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(BATCH, 1, 9, 9, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients_like_ddp(model)  # the strategy's gradient allreduce
        pre.step()
        opt.step()


def _resume_matches(rank: int, world: int, ckpt_dir: str, cases: list[tuple[str, str, float | None]]) -> dict:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = {}
    for placement, method, fraction in cases:
        model, opt, pre = _fresh(placement, method, fraction)
        _steps(rank, world, model, opt, pre, range(TOTAL))
        want = [p.detach().clone() for p in model.parameters()]

        model, opt, pre = _fresh(placement, method, fraction)
        _steps(rank, world, model, opt, pre, range(STOP))
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "kfac": pre.state_dict()}  # every rank
        path = os.path.join(ckpt_dir, f"{placement}_{method}.pt")
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
        del model, opt, pre, state
        model, opt, pre = _fresh(placement, method, fraction)
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        pre.load_state_dict(state["kfac"])
        assert set(state["kfac"]["decompositions"]) == {h.name for h in pre.handlers}  # gathered for the checkpoint
        if fraction is not None and fraction < 1:  # each rank keeps its worker group's layers only
            mine = {h.name for i, h in enumerate(pre.handlers) if pre._is_worker(i)}
            assert set(pre.decompositions) == mine and 0 < len(mine) < len(pre.handlers)
        _steps(rank, world, model, opt, pre, range(STOP, TOTAL))
        got = [p.detach() for p in model.parameters()]
        out[(placement, method, fraction)] = (all(torch.equal(a, b) for a, b in zip(got, want)),
                                              max(float((a - b).abs().max()) for a, b in zip(got, want)))  # fmt: skip
    return out


@pytest.mark.parametrize(
    "world,cases",
    [(2, [(p, m, None) for p in PLACEMENTS for m in ("eigen", "inverse")]),
     (4, [("balanced", "eigen", 0.5), ("round_robin", "inverse", 0.5)])],
)  # fmt: skip
def test_multi_rank_resume_is_bitwise_for_every_placement(tmp_path, world, cases):
    results = run_in_processes(_resume_matches, world, str(tmp_path), cases, timeout_s=300, collective_timeout_s=120)
    assert len(results[0]) == len(cases)
    for rank, res in enumerate(results):
        for (placement, method, fraction), (equal, diff) in res.items():
            assert equal, (
                f"rank {rank}, {placement}/{method}/{fraction}: resumed parameters differ from uninterrupted by up "
                f"to {diff:g}"
            )

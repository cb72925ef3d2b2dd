"""Trainer-level layered SGD: 4 CPU processes as 2 node groups x 2 against DDP and serial SGD.

One launch of 4 processes (tests/layered_sgd/trainer_script.py) runs seven fits; this file computes the serial
reference (one process, the concatenated global batch) and compares, in float64, at 1e-9:
parameters after 6 steps (momentum, weight decay, StepLR per step, gradient clipping), the gradients and lr
that ``on_before_optimizer_step`` sees, the weights that validation sees, accumulate_grad_batches=2, the
mid-epoch checkpoint, and the continuation from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_hpc.distributed import run_in_processes

sys.path.insert(0, str(Path(__file__).parent))
import trainer_script as ts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-9, atol=1e-9)


def _reference(steps: int, accumulate: int = 1):
    """Algorithm 1 with Lightning's conventions (loss / accumulate, clip by norm, scheduler after the step)."""
    model = ts.net()
    opt = torch.optim.SGD(model.parameters(), lr=ts.LR, momentum=ts.MOMENTUM, weight_decay=ts.WD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = ts.dataset()
    x, y = data.tensors
    # Lightning shards training data with DistributedSampler(shuffle=True, seed=0): the global batch b is the
    # union of every rank's b-th local batch.
    shards = [list(DistributedSampler(data, ts.WORLD, r, shuffle=True, seed=0)) for r in range(ts.WORLD)]
    L = ts.LOCAL_BATCH

    def batch(b: int) -> list[int]:
        return [i for shard in shards for i in shard[b * L : (b + 1) * L]]

    params, grads, lrs = [ts.flat(model.parameters())], [], []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            b = step * accumulate + micro
            loss = nn.functional.cross_entropy(model(x[batch(b)]), y[batch(b)])
            (loss / accumulate).backward()
        grads.append(ts.flat(p.grad for p in model.parameters()))
        lrs.append(opt.param_groups[0]["lr"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), ts.CLIP)
        opt.step()
        sched.step()
        params.append(ts.flat(model.parameters()))
    return params, grads, lrs, opt


def _trainer_rank(rank: int, world: int, out: str) -> None:
    ts.main(Path(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("layered_trainer")
    # ranks forked from the forkserver (Lightning imported there once), in a process group they join before the
    # first Trainer, which takes it as launched externally (as under torchrun)
    run_in_processes(_trainer_rank, ts.WORLD, str(out), timeout_s=900, collective_timeout_s=300,
                     env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    return {
        name: torch.load(out / f"{name}.pt", weights_only=False)
        for name in ("layered", "ddp", "layered_accum", "layered_resumed", "ddp_resumed", "layered_kfac", "ddp_kfac")
    } | {"dir": out}


def test_parameters_equal_serial_and_ddp(runs):
    params, _, _, _ = _reference(6)
    assert not torch.allclose(params[6], params[0])
    torch.testing.assert_close(runs["layered"]["final"], params[6], **TOL)
    torch.testing.assert_close(runs["ddp"]["final"], params[6], **TOL)
    torch.testing.assert_close(runs["layered"]["final"], runs["ddp"]["final"], **TOL)


def test_gradient_readers_see_global_average_with_step_settings(runs):
    """on_before_optimizer_step (clipping runs right after it) sees the global mean gradient, the lr of its own
    step (the scheduler has already moved on) and the global_step Lightning would show."""
    _, grads, lrs, _ = _reference(6)
    seen = runs["layered"]["grads"]
    assert [s for s, _, _ in seen] == list(range(6))
    for (step, lr, grad), ref_grad, ref_lr in zip(seen, grads, lrs):
        assert lr == pytest.approx(ref_lr)
        torch.testing.assert_close(grad, ref_grad, **TOL)


def test_validation_sees_updated_weights(runs):
    params, _, _, _ = _reference(6)
    seen = runs["layered"]["val"]
    assert [s for s, _ in seen] == [2, 4, 6]
    for step, weights in seen:
        torch.testing.assert_close(weights, params[step], **TOL)


def test_accumulate_grad_batches(runs):
    params, grads, _, _ = _reference(3, accumulate=2)
    torch.testing.assert_close(runs["layered_accum"]["final"], params[3], **TOL)
    for (_, _, grad), ref in zip(runs["layered_accum"]["grads"], grads):
        torch.testing.assert_close(grad, ref, **TOL)


def test_mid_epoch_checkpoint_and_resume(runs):
    params, _, _, _ = _reference(6)
    layered = torch.load(runs["dir"] / "layered_ckpt" / "epoch=0-step=3.ckpt", weights_only=False)
    ddp = torch.load(runs["dir"] / "ddp_ckpt" / "epoch=0-step=3.ckpt", weights_only=False)
    # The checkpoint holds the weights after step 3 (the postponed update was flushed) and DDP's momentum.
    torch.testing.assert_close(ts.flat(layered["state_dict"].values()), params[3], **TOL)
    for key, state in layered["optimizer_states"][0]["state"].items():
        torch.testing.assert_close(
            state["momentum_buffer"], ddp["optimizer_states"][0]["state"][key]["momentum_buffer"], **TOL
        )
    assert layered["lr_schedulers"] == ddp["lr_schedulers"]
    # Resuming continues exactly as DDP resumed from its own step-3 checkpoint does.
    torch.testing.assert_close(runs["layered_resumed"]["final"], runs["ddp_resumed"]["final"], **TOL)
    for (s1, lr1, g1), (s2, lr2, g2) in zip(runs["layered_resumed"]["grads"], runs["ddp_resumed"]["grads"]):
        assert (s1, lr1) == (s2, lr2)
        torch.testing.assert_close(g1, g2, **TOL)
    assert [s for s, _, _ in runs["layered_resumed"]["grads"]] == [3, 4, 5]


def test_kfac_callback_on_layered_sgd_equals_kfac_on_ddp(runs):
    """The K-FAC callback reads the gradients at on_before_optimizer_step: under layered SGD it must see (and
    precondition) the same globally averaged gradients as under DDP, so the runs end with the same parameters.
    (K-FAC on DDP equals single-process K-FAC: tests/kfac/test_kfac_distributed.py.)"""
    layered, ddp = runs["layered_kfac"], runs["ddp_kfac"]
    assert len(layered["after_kfac"]) == len(ddp["after_kfac"]) == 4
    for (s1, _, before), (s2, _, after) in zip(layered["grads"], layered["after_kfac"]):
        assert s1 == s2 and not torch.allclose(before, after)  # K-FAC changed the gradient
    for (_, _, g1), (_, _, g2) in zip(layered["after_kfac"], ddp["after_kfac"]):
        torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(layered["final"], ddp["final"], rtol=1e-6, atol=1e-8)

import math

import pytest
import torch

from lightning_hpc.modules.lr_scaling import ScalingRule, adjusted_weight_decay, scale_hparams
from lightning_hpc.modules.lr_schedules import warmup_multistep, warmup_multistep_factor


def test_linear_and_sqrt_rules():
    assert scale_hparams(0.1, 5e-4, 512, ScalingRule("linear", 128)) == pytest.approx((0.4, 5e-4))
    assert scale_hparams(0.1, 5e-4, 512, ScalingRule("sqrt", 128)) == pytest.approx((0.2, 5e-4))
    assert scale_hparams(0.1, 5e-4, 512, ScalingRule("none")) == (0.1, 5e-4)


def test_weight_decay_adjustment_reproduces_the_papers_example():
    # one-weird-trick section 5: N=128 -> N'=1024 (k=8), lr=0.01, wd=0.0005, lr'=sqrt(8) lr -> wd' ~ 0.0014141888
    lr, wd = scale_hparams(0.01, 0.0005, 1024, ScalingRule("sqrt", 128, adjust_weight_decay=True))
    assert lr == pytest.approx(math.sqrt(8) * 0.01)
    assert wd == pytest.approx(0.0014141888, rel=1e-7)
    # the defining identity (1 - lr wd)^k = 1 - lr' wd'
    assert (1 - 0.01 * 0.0005) ** 8 == pytest.approx(1 - lr * wd, rel=1e-12)
    assert adjusted_weight_decay(0.01, 0.0005, 1.0, 0.01) == pytest.approx(0.0005)


def test_bad_rules():
    with pytest.raises(ValueError, match="lr_scaling.rule"):
        ScalingRule("cubic", 128)
    with pytest.raises(ValueError, match="reference_batch_size"):
        ScalingRule("linear")


def test_warmup_then_milestones():
    f = lambda step: warmup_multistep_factor(step, 10, 5, [35, 75, 90], 0.1)  # noqa: E731
    assert f(0) == pytest.approx(1 / 50)
    assert f(49) == pytest.approx(1.0)
    assert f(349) == pytest.approx(1.0)
    assert f(350) == pytest.approx(0.1)
    assert f(900) == pytest.approx(0.001)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = warmup_multistep(opt, steps_per_epoch=2, warmup_epochs=0, milestones=[1], gamma=0.5)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [1.0, 1.0, 0.5, 0.5]

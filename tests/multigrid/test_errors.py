"""Bad input fails before training starts, with the numbers and the setting to change."""

import pytest
import torch
from torch import nn

from lightning_hpc.models import ResidualStep, ode_resnet
from lightning_hpc.multigrid import MultigridODEBlock, MultigridOptions, SolveSettings, check_layer_partition
from lightning_hpc.multigrid.ode_form import NotResidualError
from lightning_hpc.multigrid.strategy import MultigridStrategy
from tests.fit_harness import fit


def test_steps_not_divisible_by_ranks_and_blocks():
    with pytest.raises(
        ValueError,
        match=r"30 residual steps cannot be split into 4 layer-parallel rank\(s\) x blocks of .* multiple of 16",
    ):
        check_layer_partition(30, 4, 2, 3)
    with pytest.raises(ValueError, match="multiple of 8. Use 32 or 40 steps"):
        MultigridODEBlock(ode_resnet(num_steps=36).steps, MultigridOptions(cfactor=8, levels=2))


def test_too_few_steps_for_one_block_suggests_one_size():
    # 4 steps, 2 ranks x 4-step blocks: the message used to say "Use 8 or 8 steps"
    with pytest.raises(ValueError, match=r"must be a multiple of 8\. Use 8 steps, or change") as e:
        check_layer_partition(4, 2, 4, 2)
    assert "8 or 8" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(cfactor=1), "cfactor must be >= 2"),
        (dict(levels=0), "levels must be >= 1"),
        (dict(relaxation="C"), "relaxation must be one of"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultigridOptions(**kwargs)
    with pytest.raises(ValueError, match="tol must be positive"):
        SolveSettings(2, tol=0.0)
    with pytest.raises(ValueError, match="cycles must be >= 1"):
        SolveSettings(cycles=0)


def test_model_not_in_residual_form():
    trunk = nn.Sequential(*[ResidualStep(nn.Conv2d(2, 2, 3, padding=1), 0.1) for _ in range(3)], nn.ReLU())
    with pytest.raises(NotResidualError, match=r"block 3 \(ReLU"):
        MultigridODEBlock(trunk, MultigridOptions(cfactor=2, levels=2))


def test_shape_changing_step_fails_at_first_forward():
    trunk = nn.Sequential(
        ResidualStep(nn.Conv2d(2, 2, 3, padding=1), 0.1), ResidualStep(nn.Conv2d(2, 2, 3, padding=1, stride=2), 0.1)
    )
    block = MultigridODEBlock(trunk, MultigridOptions(cfactor=2, levels=2))
    with pytest.raises(NotResidualError, match="block 1 .* maps a state of shape"):
        block(torch.randn(1, 2, 8, 8))


def test_heterogeneous_branches_cannot_be_stacked():
    trunk = nn.Sequential(
        ResidualStep(nn.Conv2d(2, 2, 3, padding=1), 0.1), ResidualStep(nn.Conv2d(2, 2, 5, padding=2), 0.1)
    )
    with pytest.raises(ValueError, match="residual step 1 has a branch of different structure than step 0"):
        MultigridODEBlock(trunk, MultigridOptions(cfactor=2, levels=2))


def test_strategy_rejects_bad_settings_at_construction():
    with pytest.raises(ValueError, match="mode must be one of"):
        MultigridStrategy(mode="fast")
    with pytest.raises(ValueError, match="relaxation must be one of"):
        MultigridStrategy(relaxation="X")
    with pytest.raises(ValueError, match="layer_parallel_size must be >= 1"):
        MultigridStrategy(layer_parallel_size=0)


def test_strategy_missing_trunk_and_indivisible_depth():
    from lightning_hpc import ImageClassifier
    from lightning_hpc.data import DigitsDataModule

    model = ImageClassifier(ode_resnet(num_steps=6))
    with pytest.raises(ValueError, match=r"no attribute 'blocks'.*ODEResNet calls it 'steps'"):
        fit(model, datamodule=DigitsDataModule(batch_size=8), strategy=MultigridStrategy(trunk="blocks"),
            fast_dev_run=True)
    with pytest.raises(ValueError, match="6 residual steps cannot be split .* multiple of 4"):
        fit(ImageClassifier(ode_resnet(num_steps=6)), datamodule=DigitsDataModule(batch_size=8),
            strategy=MultigridStrategy(cfactor=4), fast_dev_run=True)

"""Which user code makes layered SGD update at once, and the trainability record strategies refuse changes with.

The end-to-end proofs (2 processes against one, through ``Trainer.fit``) are the conformance rows
``optimizer_step_override``, ``grad_norm_logging``, ``backbone_finetuning`` and ``freeze_mid_run``; these tests
pin the decisions themselves, without processes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    LearningRateMonitor,
    ModelCheckpoint,
    Timer,
    TQDMProgressBar,
    WeightAveraging,
)
from torch import nn
from typing_extensions import override

from lightning_hpc import KFAC
from lightning_hpc.distributed.trainability import REBUILD_FIX, TrainabilityChanged, TrainableSet
from lightning_hpc.layered_sgd.strategy import backward_observers, step_observers


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)


class Clamping(Plain):
    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


class LogsGradNorm(Plain):
    @override
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


class ReadsWeights(Callback):
    @override
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        pass


class CountsSteps(Callback):
    postponed_update_safe = True

    @override
    def on_before_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_nothing_observes_with_lightnings_own_callbacks_and_kfac():
    """The default progress bar and checkpointing, a learning-rate monitor, K-FAC and a callback that declares
    itself safe keep the postponed update (the technique's overlap with the next batch's loading)."""
    callbacks = [TQDMProgressBar(), ModelCheckpoint(), LearningRateMonitor(), KFAC(), CountsSteps()]
    assert step_observers(Plain(), callbacks) == []


@pytest.mark.parametrize(
    ("module", "callbacks", "expected"),
    [
        (Clamping(), [], ["Clamping.optimizer_step"]),
        (LogsGradNorm(), [], ["LogsGradNorm.on_before_optimizer_step"]),
        (Plain(), [ReadsWeights()], ["ReadsWeights.on_train_batch_end"]),
        (Plain(), [WeightAveraging()], ["WeightAveraging.on_train_batch_end"]),
    ],
)
def test_user_code_around_the_step_is_an_observer(module, callbacks, expected):
    assert step_observers(module, [TQDMProgressBar(), *callbacks]) == expected


class CheckpointReadingWeights(ModelCheckpoint):
    @override
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(*args, **kwargs)


class CheckpointWithExtraState(ModelCheckpoint):
    """Overrides no step hook: Lightning's own ``on_train_batch_end`` still runs."""

    @override
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict()


class BarShowingWeightNorm(TQDMProgressBar):
    @override
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(*args, **kwargs)


class TimerProjecting(Timer):
    @override
    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(*args, **kwargs)


class KFACLoggingNorm(KFAC):
    """Adds its own ``on_before_optimizer_step`` after KFAC declared itself safe: the declaration is KFAC's."""

    @override
    def on_before_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().on_before_optimizer_step(*args, **kwargs)


class KFACLoggingNormDeclared(KFACLoggingNorm):
    postponed_update_safe = True


@pytest.mark.parametrize(
    ("callback", "expected"),
    [
        (CheckpointReadingWeights(), ["CheckpointReadingWeights.on_train_batch_end"]),
        (BarShowingWeightNorm(), ["BarShowingWeightNorm.on_train_batch_end"]),
        (TimerProjecting(), ["TimerProjecting.on_train_batch_end"]),
        (KFACLoggingNorm(), ["KFACLoggingNorm.on_before_optimizer_step"]),
        (CheckpointWithExtraState(), []),
        (KFACLoggingNormDeclared(), []),
    ],
)
def test_a_subclass_of_a_trusted_callback_is_judged_by_the_hooks_it_overrides(callback, expected):
    """Lightning's checkpointing, progress bar and timer (and a ``postponed_update_safe`` class) are trusted for
    their own hook implementations only: a subclass that overrides a step hook runs user code there."""
    assert step_observers(Plain(), [callback]) == expected


class GradCheck(Plain):
    @override
    def on_after_backward(self) -> None:
        pass


class CallbackGradCheck(Callback):
    postponed_update_safe = True  # covers the step hooks, not the backward pass

    @override
    def on_after_backward(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_on_after_backward_in_user_code_is_found():
    assert backward_observers(Plain(), [TQDMProgressBar(), ModelCheckpoint(), KFAC(), CountsSteps()]) == []
    assert backward_observers(GradCheck(), [CallbackGradCheck()]) == [
        "GradCheck.on_after_backward", "CallbackGradCheck.on_after_backward"]
    assert step_observers(GradCheck(), [CallbackGradCheck()]) == []


def test_trainable_set_names_the_changes_and_refuses_them():
    module = Plain()
    module.stem.requires_grad_(False)
    record = TrainableSet(module)
    assert not record.changed(module)
    record.refuse_changes(module, "strategy='x'", REBUILD_FIX)  # no change: no error
    module.stem.requires_grad_(True)
    module.head.bias.requires_grad_(False)
    assert record.changes(module) == (["stem.weight", "stem.bias"], ["head.bias"])
    with pytest.raises(TrainabilityChanged, match=r"strategy='x': parameters of Plain became trainable: "
                       r"\['stem.weight', 'stem.bias'\]; were frozen: \['head.bias'\].*refused before it is taken"):
        record.refuse_changes(module, "strategy='x'", REBUILD_FIX)


def test_a_new_parameter_object_is_a_change():
    """``requires_grad`` is recorded per parameter object: a replaced parameter is a change too."""
    module = Plain()
    record = TrainableSet(module)
    module.head.weight = nn.Parameter(torch.zeros(2, 4))
    assert record.changes(module) == (["head.weight"], [])

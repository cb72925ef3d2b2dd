"""The Lightning adapters: callback placement in the step, checkpoint resume, precision plugin, setup errors."""

from __future__ import annotations

import copy
import warnings
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC, ImageClassifier, KFACMixedPrecision, KFACPreconditioner
from tests import fit_harness

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 3, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )  # fmt: skip


def _loader(n: int = 40, batch: int = 8, huge_batch: int | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)
    if huge_batch is not None:
        x[huge_batch * batch : (huge_batch + 1) * batch] *= 1e6  # overflows fp16 activations
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _module() -> ImageClassifier:
    return ImageClassifier(_net(), optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9), num_classes=5)


#: the Trainer options every run here shares (on top of the harness's quiet CPU Trainer)
RUN = dict(deterministic=True, num_sanity_val_steps=0)


def _kfac(**kw) -> KFAC:
    opts = dict(
        factor_update_freq=1,
        inv_update_freq=3,
        damping=0.03,
        damping_decay_epochs=[1],
        damping_decay_rate=0.5,
        kl_clip=0.01,
    )
    opts.update(kw)
    return KFAC(**opts)


class Record(Callback):
    """Copies of the running factors and the grad scale after every optimizer step."""

    def __init__(self, kfac: KFAC) -> None:
        self.kfac, self.factors, self.scales = kfac, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.factors.append(copy.deepcopy(self.kfac.preconditioner.factors))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)


def test_callback_matches_plain_preconditioner_loop():
    torch.manual_seed(0)
    module, kfac = _module(), _kfac()
    fit_harness.trainer(max_epochs=1, callbacks=[kfac], **RUN).fit(module, _loader(), _loader(16))
    # Same thing by hand (paper Listing 1): identical parameters.
    ref = _module()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    pre = KFACPreconditioner(ref, optimizer=opt, factor_update_freq=1, inv_update_freq=3, damping=0.03, kl_clip=0.01)
    ref.train()
    for x, y in _loader():
        opt.zero_grad()
        ref.loss(ref(x), y).backward()
        pre.step()
        opt.step()
    for a, b in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert kfac.preconditioner.steps == 5


def test_validation_and_no_grad_forwards_do_not_touch_factors():
    module, kfac = _module(), _kfac()
    rec = Record(kfac)
    fit_harness.trainer(max_epochs=1, callbacks=[kfac, rec], limit_train_batches=2, **RUN).fit(
        module, _loader(), _loader(16)
    )
    pre = kfac.preconditioner
    before = copy.deepcopy(pre.factors)
    x = torch.randn(8, 1, 8, 8)
    module.train()
    with torch.no_grad():
        module(x)
    module.eval()
    module(x).sum().backward()
    assert all(not h.has_statistics and h.a_sum is None for h in pre.handlers)
    pre.step()  # a factor-update step with nothing captured: warns, keeps the factors
    for name in before:
        for k in before[name]:
            assert torch.equal(pre.factors[name][k], before[name][k])


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.body(x)


def test_module_whose_hooks_never_fire_warns_once_and_is_skipped():
    model = _WithUnused()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, optimizer=opt, inv_update_freq=1, kl_clip=None)
    with pytest.warns(RuntimeWarning, match="'unused'") as record:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            pre.step()
            opt.step()
    assert sum("'unused'" in str(w.message) for w in record) == 1
    assert "unused" not in pre.factors and "body" in pre.factors
    assert model.unused.weight.grad is None


def test_resume_from_checkpoint_equals_uninterrupted(tmp_path):
    full_module, full_kfac = _module(), _kfac()
    fit_harness.trainer(max_epochs=2, callbacks=[full_kfac], **RUN).fit(full_module, _loader(), _loader(16))

    first_module, first_kfac = _module(), _kfac()
    trainer = fit_harness.trainer(max_epochs=1, callbacks=[first_kfac], **RUN)
    trainer.fit(first_module, _loader(), _loader(16))
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed_module, resumed_kfac = _module(), _kfac()
    fit_harness.trainer(max_epochs=2, callbacks=[resumed_kfac], **RUN).fit(
        resumed_module, _loader(), _loader(16), ckpt_path=ckpt
    )
    assert resumed_kfac.preconditioner.steps == full_kfac.preconditioner.steps == 10
    for a, b in zip(full_module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)  # bitwise on CPU
    for name, f in full_kfac.preconditioner.factors.items():
        for k in f:
            assert torch.equal(f[k], resumed_kfac.preconditioner.factors[name][k])


class _PlacingStrategy(pl.strategies.SingleDeviceStrategy):
    """Records when its setup has placed the model on the device (on a GPU: after the move to it)."""

    placed = False

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self.placed = True


def test_restored_factors_are_placed_after_the_strategy_places_the_model(tmp_path):
    """Lightning restores callbacks before the strategy moves the model to its device, and the callback built its
    preconditioner in setup already: loading the factors then would put them where the model was, not where it
    trains (on a GPU: the CPU). They must be loaded once the strategy has placed the model."""
    trainer = fit_harness.trainer(max_epochs=1, callbacks=[_kfac()], **RUN)
    trainer.fit(_module(), _loader())
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)

    kfac, seen = _kfac(), []
    strategy = _PlacingStrategy(device=torch.device("cpu"))

    original_setup = KFAC.setup

    def setup_then_spy(self, trainer, pl_module, stage):
        original_setup(self, trainer, pl_module, stage)
        pre = self.preconditioner
        if pre is not None:
            load = pre.load_state_dict

            def recorded(state):
                seen.append(("load", strategy.placed))
                load(state)

            pre.load_state_dict = recorded

    kfac.setup = setup_then_spy.__get__(kfac)
    resumed = fit_harness.trainer(
        accelerator="auto", devices="auto", max_epochs=2, strategy=strategy, callbacks=[kfac], num_sanity_val_steps=0
    )
    resumed.fit(_module(), _loader(), ckpt_path=ckpt)
    loads = [placed for what, placed in seen if what == "load"]
    assert loads == [True], seen
    assert kfac.preconditioner.steps == 10


def test_fp16_without_kfac_plugin_fails_at_setup():
    # (On CPU Lightning turns precision="16-mixed" into bf16; its fp16 plugin is what a GPU run would get.)
    trainer = fit_harness.trainer(max_epochs=1, callbacks=[_kfac()], plugins=[MixedPrecision("16-mixed", "cpu")], **RUN)
    with pytest.raises(ValueError, match="KFACMixedPrecision"):
        trainer.fit(_module(), _loader(), _loader(16))
    assert trainer.global_step == 0


def test_grad_worker_fraction_that_does_not_fit_the_world_fails_at_setup():
    """The world size is known at setup: a fraction it cannot realise is refused before the first step; fraction 1
    on one process trains (bfloat16 storage options travel with it)."""
    trainer = fit_harness.trainer(max_epochs=1, callbacks=[_kfac(grad_worker_fraction=0.5)], **RUN)
    with pytest.raises(ValueError, match="grad_worker_fraction=0.5 on 1 ranks"):
        trainer.fit(_module(), _loader(), _loader(16))
    assert trainer.global_step == 0
    kfac = _kfac(grad_worker_fraction=1.0, factor_dtype="bfloat16", inverse_dtype="bfloat16")
    fit_harness.trainer(max_epochs=1, callbacks=[kfac], limit_train_batches=2, **RUN).fit(
        _module(), _loader(), _loader(16)
    )
    pre = kfac.preconditioner
    assert pre.steps == 2 and pre.grad_worker_fraction == 1.0
    assert {v.dtype for f in pre.factors.values() for v in f.values()} == {torch.bfloat16}
    assert {v.dtype for d in pre.decompositions.values() for v in d.values()} == {torch.bfloat16}


def test_fp16_statistics_are_unscaled():
    runs = {}
    for prec in ("32", "16"):
        kfac = _kfac(inv_update_freq=100)
        rec = Record(kfac)
        plugins = [KFACMixedPrecision("16-mixed", "cpu")] if prec == "16" else None
        fit_harness.trainer(max_epochs=1, callbacks=[kfac, rec], limit_train_batches=1, plugins=plugins, **RUN).fit(
            _module(), _loader(), _loader(16)
        )
        runs[prec] = rec
    assert runs["16"].scales[0] >= 2.0**10  # the backward pass really ran on a scaled loss
    for name, f in runs["32"].factors[0].items():
        for k in f:
            torch.testing.assert_close(
                runs["16"].factors[0][name][k], f[k], rtol=2e-2, atol=2e-3 * f[k].abs().max().item()
            )


def test_fp16_overflow_step_leaves_factors_unchanged():
    kfac = _kfac()
    rec = Record(kfac)
    module = _module()
    plugins = [KFACMixedPrecision("16-mixed", "cpu")]
    fit_harness.trainer(max_epochs=1, callbacks=[kfac, rec], plugins=plugins, **RUN).fit(
        module, _loader(huge_batch=2), _loader(16)
    )
    assert rec.scales[2] < rec.scales[1], "the overflow step was not skipped by the grad scaler"
    for name in rec.factors[1]:
        for k in rec.factors[1][name]:
            assert torch.equal(rec.factors[2][name][k], rec.factors[1][name][k])
            assert not torch.equal(rec.factors[3][name][k], rec.factors[2][name][k])  # normal steps update again
    assert kfac.preconditioner.steps == 4  # the skipped step does not count
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_bf16_keeps_factors_and_decompositions_fp32():
    kfac = _kfac()
    fit_harness.trainer(max_epochs=1, callbacks=[kfac], precision="bf16-mixed", limit_train_batches=3, **RUN).fit(
        _module(), _loader(), _loader(16)
    )
    pre = kfac.preconditioner
    assert pre.factors and all(t.dtype == torch.float32 for f in pre.factors.values() for t in f.values())
    assert pre.decompositions and all(t.dtype == torch.float32 for d in pre.decompositions.values() for t in d.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(factor_update_freq=0), "factor_update_freq"),
        (dict(inv_update_freq=-5), "inv_update_freq"),
        (dict(damping=-1e-3), "damping"),
        (dict(placement="random"), "placement"),
        (dict(compute_method="cholesky"), "compute_method"),
        (dict(factor_decay=1.0), "factor_decay"),
        (dict(kl_clip=-1.0), "kl_clip"),
        (dict(decomposition_dtype="float16"), "decomposition_dtype"),
        (dict(damping_decay_rate=0.0), "damping_decay_rate"),
    ],
)
def test_bad_arguments_fail_early(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KFAC(**kwargs)
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(nn.Linear(2, 2), **kwargs)


def test_skip_layers_by_name_and_class_and_no_layers_left():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2), nn.Linear(2, 2))
    pre = KFACPreconditioner(model, skip_layers=[r"^2$", "Conv2d"])
    assert [h.name for h in pre.handlers] == ["3"]
    with pytest.raises(ValueError, match="skip_layers"):
        KFACPreconditioner(model, skip_layers="Linear|Conv")
    with pytest.raises(ValueError, match="regular expression"):
        KFACPreconditioner(model, skip_layers="(")


def test_schedules_follow_epochs():
    pre = KFACPreconditioner(
        nn.Linear(2, 2), damping=0.01, damping_decay_epochs=[2, 4], damping_decay_rate=0.5,
        inv_update_freq=100, update_freq_decay_epochs=[3], update_freq_decay_rate=0.1,
    )  # fmt: skip
    seen = []
    for epoch in range(5):
        pre.set_epoch(epoch)
        seen.append((pre.damping, pre.factor_update_freq, pre.inv_update_freq))
    assert seen == [(0.01, 10, 100), (0.01, 10, 100), (0.005, 10, 100), (0.005, 1, 10), (0.0025, 1, 10)]
    # a rate that leaves a fraction: the nearest interval (10 x 0.37 = 3.7 -> 4, not 3), never below 1
    pre = KFACPreconditioner(nn.Linear(2, 2), inv_update_freq=100, update_freq_decay_epochs=[1, 2],
                             update_freq_decay_rate=0.37)  # fmt: skip
    seen = []
    for epoch in range(3):
        pre.set_epoch(epoch)
        seen.append((pre.factor_update_freq, pre.inv_update_freq))
    assert seen == [(10, 100), (4, 37), (1, 14)]


def test_the_epoch_and_its_schedules_survive_a_checkpoint():
    """A plain loop that resumes from ``state_dict()`` continues the damping and interval schedules at the saved
    epoch (Lightning's callback sets the epoch again; a plain loop need not)."""
    def make() -> KFACPreconditioner:
        return KFACPreconditioner(nn.Linear(2, 2), damping=0.01, damping_decay_epochs=[2], damping_decay_rate=0.5,
                                  inv_update_freq=100, update_freq_decay_epochs=[3], update_freq_decay_rate=0.1,
                                  announce=False)  # fmt: skip

    pre = make()
    pre.set_epoch(3)
    resumed = make()
    resumed.load_state_dict(pre.state_dict())
    assert (resumed.epoch, resumed.damping, resumed.factor_update_freq, resumed.inv_update_freq) == (3, 0.005, 1, 10)


def test_accumulate_grad_batches_covers_every_micro_batch():
    def net() -> nn.Module:  # no BatchNorm: micro-batches must see the same function as the full batch
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 6, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(54, 5),
        )

    results = []
    for batch, accumulate in ((16, 1), (8, 2)):
        module = ImageClassifier(net(), optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9), num_classes=5)
        kfac = _kfac()
        # 48 samples: whole accumulation groups (Lightning divides a short last group's loss by the full count)
        fit_harness.trainer(max_epochs=1, callbacks=[kfac], accumulate_grad_batches=accumulate, **RUN).fit(
            module, _loader(48, batch=batch), _loader(16)
        )
        results.append((module, kfac.preconditioner))
    (full, pre_full), (acc, pre_acc) = results
    assert pre_full.steps == pre_acc.steps == 3
    for name, f in pre_full.factors.items():
        for k in f:
            torch.testing.assert_close(pre_acc.factors[name][k], f[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(full.parameters(), acc.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)

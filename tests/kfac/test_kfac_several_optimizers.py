"""K-FAC with several optimizers (a GAN's generator and discriminator): one preconditioner per optimizer, over the
layers whose parameters it steps, each layer's statistics those of the backward passes since its optimizer's
gradients were last cleared.

The reference is built without the mechanism under test: a preconditioner on each sub-network alone (no
``parameters=`` filter), whose hooks are idled explicitly wherever a pass must not count (the generator step's pass
through the discriminator, whose gradients ``zero_grad`` clears before the discriminator's step)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.layers import LayerHandler
from tests.fit_harness import fit

OPTIONS: dict[str, Any] = dict(factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01,
                               factor_dtype="float64", decomposition_dtype="float64")
STEPS = 5


class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6)).double()
        self.discriminator = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


def optimizers(gan: Gan) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(gan.generator.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(gan.discriminator.parameters(), lr=0.05, momentum=0.9)]


def gan_step(gan: nn.Module, z: torch.Tensor, real: torch.Tensor, opts: list[Any], step: Callable[[int], Any], *,
             backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward,
             phase: Callable[[int], AbstractContextManager[Any]] = lambda i: nullcontext(),
             idle_d_in_g_step: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
    """One iteration as Lightning's docs write a GAN: the generator's step (its loss through the discriminator),
    then the discriminator's on real and detached fake samples; each optimizer's gradients cleared after the
    forward passes, before its backward pass (``phase(i)``: around optimizer ``i``'s part)."""
    g_opt, d_opt = opts
    with phase(0):
        fake = gan.generator(z)
        with idle_d_in_g_step():
            d_fake = gan.discriminator(fake)
        g_loss = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        g_opt.zero_grad()
        backward(g_loss)
        step(0)
    with phase(1):
        d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
        d_loss = 0.5 * (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                        + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        d_opt.zero_grad()
        backward(d_loss)
        step(1)


def train_plain(*, reference: bool, count_g_pass_for_d: bool = False,
                device: str = "cpu") -> tuple[Gan, list[KFACPreconditioner]]:
    gan = Gan().to(device)
    opts = optimizers(gan)
    if reference:  # each sub-network's own preconditioner
        pres = [KFACPreconditioner(gan.generator, optimizer=opts[0], announce=False, **OPTIONS),
                KFACPreconditioner(gan.discriminator, optimizer=opts[1], announce=False, **OPTIONS)]
    else:  # the whole model's layers, filtered by each optimizer's parameters
        pres = [KFACPreconditioner(gan, parameters=list(opt.param_groups[0]["params"]), optimizer=opt,
                                   announce=False, **OPTIONS) for opt in opts]
    idle = nullcontext if (count_g_pass_for_d or not reference) else pres[1].capture_hooks.idle

    def step(i: int) -> None:
        pres[i].step()
        opts[i].step()

    for z, real in batches():
        gan_step(gan, z.to(device), real.to(device), opts, step, idle_d_in_g_step=idle)
    return gan, pres


def assert_same_parameters(a: nn.Module | list[torch.Tensor], b: nn.Module | list[torch.Tensor],
                           atol: float = 1e-12) -> None:
    pa = list(a.parameters()) if isinstance(a, nn.Module) else a
    pb = list(b.parameters()) if isinstance(b, nn.Module) else b
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def test_per_optimizer_preconditioners_equal_each_sub_network_alone() -> None:
    gan, pres = train_plain(reference=False)
    ref, ref_pres = train_plain(reference=True)
    assert [h.name for h in pres[0].handlers] == ["generator.0", "generator.2"]
    assert [h.name for h in pres[1].handlers] == ["discriminator.0", "discriminator.2"]
    assert [p.steps for p in pres] == [STEPS, STEPS]
    for pre, r in zip(pres, ref_pres):
        for h, hr in zip(pre.handlers, r.handlers):
            for k, f in h.factors.items():
                torch.testing.assert_close(f, hr.factors[k], rtol=0, atol=1e-13)
    assert_same_parameters(gan, ref)
    # what K-FAC changed is large against the tolerance: the same loop with SGD alone ends elsewhere
    sgd = Gan()
    opts = optimizers(sgd)
    for z, real in batches():
        gan_step(sgd, z, real, opts, lambda i: opts[i].step())
    assert max((a - b).abs().max().item() for a, b in zip(gan.parameters(), sgd.parameters())) > 1e-3


def test_counting_the_generator_steps_pass_for_the_discriminator_would_change_the_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: were the generator step's pass through the discriminator (whose gradients zero_grad clears
    before the discriminator's step) kept in its statistics, the run would end elsewhere; so the equality above
    sees which passes are counted."""
    ref, _ = train_plain(reference=True)
    # statistics kept across zero_grad
    monkeypatch.setattr(LayerHandler, "is_stale", lambda self: False)
    monkeypatch.setattr(LayerHandler, "stale_before", lambda self, token: False)
    counted, _ = train_plain(reference=True, count_g_pass_for_d=True)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.discriminator.parameters(),
                                                          counted.discriminator.parameters()))
    assert diff > 1e-6


def test_a_layer_whose_weight_and_bias_two_optimizers_step_is_left_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    pre = KFACPreconditioner(model, parameters=[model[0].weight, model[1].weight, model[1].bias], announce=False,
                             factor_dtype="float64")
    assert [h.name for h in pre.handlers] == ["1"]
    assert [(n, "only some of its trainable parameters" in why) for n, _, why in pre.skipped_modules] == [("0", True)]
    model(torch.randn(5, 3, dtype=torch.float64)).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    pre.step(lr=0.1)
    after = [p.grad for p in model.parameters()]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])  # left to the optimizers
    assert not torch.equal(after[2], before[2])  # (the other layer is preconditioned)
    # the other optimizer (the first layer's bias alone) holds no whole layer
    with pytest.raises(ValueError, match="among the given parameters"):
        KFACPreconditioner(model, parameters=[model[0].bias], announce=False)


def train_accumulating(*, reference: bool) -> Gan:
    """The generator steps every iteration with the discriminator frozen (``toggle_optimizer``'s way); the
    discriminator accumulates two iterations' gradients and steps every second one, clearing them after its step. Its
    weights take no gradient in the generator's passes, so those passes are not its statistics (the reference keeps
    them out by hand; the mechanism under test sees the frozen weight)."""
    gan = Gan()
    opts = optimizers(gan)
    if reference:
        pres = [KFACPreconditioner(gan.generator, optimizer=opts[0], announce=False, **OPTIONS),
                KFACPreconditioner(gan.discriminator, optimizer=opts[1], announce=False, **OPTIONS)]
    else:
        pres = [KFACPreconditioner(gan, parameters=list(opt.param_groups[0]["params"]), optimizer=opt,
                                   announce=False, **OPTIONS) for opt in opts]
    for k, (z, real) in enumerate(batches()):
        gan.discriminator.requires_grad_(False)
        fake = gan.generator(z)
        with pres[1].capture_hooks.idle() if reference else nullcontext():
            d_fake = gan.discriminator(fake)
        F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake)).backward()
        pres[0].step()
        opts[0].step()
        opts[0].zero_grad()
        gan.discriminator.requires_grad_(True)
        d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
        (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
         + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))).backward()
        if k % 2 == 1:
            pres[1].step()
            opts[1].step()
            opts[1].zero_grad()
    assert [p.steps for p in pres] == [STEPS, STEPS // 2]
    return gan


def test_passes_in_which_the_weight_is_frozen_are_not_its_statistics() -> None:
    assert_same_parameters(train_accumulating(reference=False), train_accumulating(reference=True))


def train_wgan_gp(*, idle_penalty: bool, zero_grad_first: bool) -> Gan:
    """WGAN-GP: the critic's loss holds a penalty on its input gradient at interpolated samples, taken with
    ``torch.autograd.grad`` (whose pass fires the output-gradient hooks with the gradient of the critic's output, not
    of the loss). ``idle_penalty``: the reference, that pass kept out of the statistics by hand."""
    gan = Gan()
    opts = optimizers(gan)
    pres = [KFACPreconditioner(gan, parameters=list(opt.param_groups[0]["params"]), optimizer=opt, announce=False,
                               **OPTIONS) for opt in opts]
    g = torch.Generator().manual_seed(2)
    for z, real in batches():
        if zero_grad_first:
            opts[1].zero_grad()
        fake = gan.generator(z)
        eps = torch.rand(len(z), 1, generator=g, dtype=z.dtype)
        interp = (eps * real + (1 - eps) * fake.detach()).requires_grad_(True)
        with pres[1].capture_hooks.idle() if idle_penalty else nullcontext():
            (slope,) = torch.autograd.grad(gan.discriminator(interp).sum(), interp, create_graph=True)
        d_loss = (gan.discriminator(fake.detach()).mean() - gan.discriminator(real).mean()
                  + 10 * ((slope.norm(dim=1) - 1) ** 2).mean())
        if not zero_grad_first:
            opts[1].zero_grad()
        d_loss.backward()
        pres[1].step()
        opts[1].step()
        opts[0].zero_grad()
        (-gan.discriminator(gan.generator(z)).mean()).backward()
        pres[0].step()
        opts[0].step()
    return gan


@pytest.mark.parametrize("zero_grad_first", [True, False], ids=["zero_grad_first", "zero_grad_before_backward"])
def test_a_gradient_penalty_pass_is_not_among_the_critics_statistics(zero_grad_first: bool) -> None:
    """The penalty's ``autograd.grad`` pass gives the critic's weights no gradient of their own (the loss's backward
    pass differentiates the penalty through it), so its statistics are dropped as the loss's backward pass arrives
    with the gradients cleared; equal to the reference that keeps them out by hand."""
    assert_same_parameters(train_wgan_gp(idle_penalty=False, zero_grad_first=zero_grad_first),
                           train_wgan_gp(idle_penalty=True, zero_grad_first=zero_grad_first))


def test_counting_the_penalty_pass_would_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the test above: with the statistics kept across zero_grad, the critic ends elsewhere."""
    reference = train_wgan_gp(idle_penalty=True, zero_grad_first=False)
    monkeypatch.setattr(LayerHandler, "is_stale", lambda self: False)
    monkeypatch.setattr(LayerHandler, "stale_before", lambda self, token: False)
    counted = train_wgan_gp(idle_penalty=False, zero_grad_first=False)
    assert max((a - b).abs().max().item() for a, b in zip(counted.parameters(), reference.parameters())) > 1e-3


# -- through Lightning ----------------------------------------------------------------------------------------------
class LightningGan(pl.LightningModule):
    """The GAN of the plain loops as a user writes it in Lightning: manual optimization, two optimizers."""

    def __init__(self, toggle: bool = False) -> None:
        super().__init__()
        gan = Gan()
        self.generator, self.discriminator = gan.generator, gan.discriminator
        self.toggle = toggle
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opts = self.optimizers()[:2]

        @contextmanager
        def toggled(i: int) -> Iterator[None]:
            # Lightning's idiom: the other optimizer's parameters frozen during each optimizer's part
            if self.toggle:
                self.toggle_optimizer(opts[i])
            yield
            if self.toggle:
                self.untoggle_optimizer(opts[i])

        gan_step(self, *batch, opts, lambda i: opts[i].step(), backward=self.manual_backward, phase=toggled)

    def configure_optimizers(self) -> Any:
        return optimizers(self)  # type: ignore[arg-type]


def loader() -> DataLoader:
    zs, reals = zip(*batches())
    return DataLoader(TensorDataset(torch.cat(zs), torch.cat(reals)), batch_size=8)


@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "toggle_optimizer"])
def test_callback_trains_a_gan_as_the_per_network_loop(toggle: bool) -> None:
    kfac = KFAC(**OPTIONS)
    run = fit(LightningGan(toggle), loader(), max_epochs=1, callbacks=[kfac], record_warnings=True)
    ref, _ = train_plain(reference=True)
    assert_same_parameters(run.params, list(ref.parameters()))
    assert sorted(kfac.preconditioners) == [0, 1]
    assert [p.steps for p in kfac.preconditioners.values()] == [STEPS, STEPS]
    with pytest.raises(RuntimeError, match="KFAC.preconditioners"):
        _ = kfac.preconditioner


class GanWithTemperature(LightningGan):
    """The GAN and a third optimizer over a parameter no K-FAC layer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        t_opt = self.optimizers()[2]
        t_opt.zero_grad()
        self.manual_backward((self.temperature - 2) ** 2)
        t_opt.step()

    def configure_optimizers(self) -> Any:
        return [*optimizers(self), torch.optim.SGD([self.temperature], lr=0.1)]  # type: ignore[arg-type]


def test_an_optimizer_without_layers_gets_no_preconditioner() -> None:
    kfac = KFAC(**OPTIONS)
    run = fit(GanWithTemperature(), loader(), max_epochs=1, callbacks=[kfac], record_warnings=True)
    assert sorted(kfac.preconditioners) == [0, 1]
    ref, _ = train_plain(reference=True)
    assert_same_parameters(run.params[1:], list(ref.parameters()))  # (the module's own parameter comes first)
    torch.testing.assert_close(run.params[0], torch.tensor(2.0, dtype=torch.float64) - torch.tensor(
        0.8, dtype=torch.float64) ** STEPS, rtol=0, atol=1e-12)  # plain SGD on (t - 2)^2: t -> 2 - 0.8^k


def test_resume_from_a_checkpoint_continues_every_preconditioner(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    whole = fit(LightningGan(), loader(), max_epochs=2, callbacks=[KFAC(**OPTIONS)])
    # one epoch, checkpointed at its end, then resumed from the checkpoint for the second
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    first = fit(LightningGan(), loader(), max_epochs=1, callbacks=[KFAC(**OPTIONS), ckpt], enable_checkpointing=True)
    assert first.steps == 2 * STEPS  # (manual optimization: each optimizer's step counts)
    (path,) = tmp_path.glob("*.ckpt")
    state = torch.load(path, weights_only=False)["callbacks"]
    kfac_state = next(v for k, v in state.items() if k.startswith("KFAC"))
    assert sorted(kfac_state["per_optimizer"]) == [0, 1]
    kfac = KFAC(**OPTIONS)
    resumed = fit(LightningGan(), loader(), max_epochs=2, callbacks=[kfac], ckpt_path=str(path))
    assert [p.steps for p in kfac.preconditioners.values()] == [2 * STEPS, 2 * STEPS]
    assert_same_parameters(resumed.params, whole.params)


def test_a_checkpoint_of_one_optimizer_does_not_load_into_several() -> None:
    kfac = KFAC(**OPTIONS)
    single = KFACPreconditioner(Gan(), announce=False, **OPTIONS).state_dict()
    kfac.load_state_dict(single)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = fit(LightningGan(), loader(), max_epochs=1, callbacks=[kfac], refusal_is_result=True)
    assert run.error is not None and "resume with the configure_optimizers" in run.error
    assert run.steps == 0


def _ddp_overlap_run(rank: int, world_size: int) -> dict[Any, Any]:
    """Each rank trains on its half of every batch under DDP; with and without the overlapped factor all-reduce,
    which the generator step's pass launches for the discriminator's layers too (statistics then dropped); and with
    KAISA's layer-wise placement (each layer's decompositions and preconditioning on one rank, broadcast), whose
    process groups each preconditioner makes."""
    from lightning.pytorch.strategies import DDPStrategy

    zs, reals = zip(*batches())
    half = slice(rank * 4, (rank + 1) * 4)
    data = DataLoader(TensorDataset(torch.cat([z[half] for z in zs]), torch.cat([r[half] for r in reals])),
                      batch_size=4)
    out = {}
    for overlap in (False, True):
        kfac = KFAC(**OPTIONS, overlap_factor_allreduce=overlap, bucket_cap_mb=1e-4)
        run = fit(LightningGan(), data, devices=world_size, strategy=DDPStrategy(find_unused_parameters=True),
                  max_epochs=1, callbacks=[kfac], use_distributed_sampler=False, record_warnings=True)
        assert [p.steps for p in kfac.preconditioners.values()] == [STEPS, STEPS]
        out[overlap] = [p.numpy() for p in run.params]
        # the launch of the dropped statistics was abandoned, not found late at the step and reduced again
        out["late", overlap] = run.warned("captured after a layer's factors had been launched")
    kfac = KFAC(**OPTIONS, placement="layer_wise")
    run = fit(LightningGan(), data, devices=world_size, strategy=DDPStrategy(find_unused_parameters=True),
              max_epochs=1, callbacks=[kfac], use_distributed_sampler=False)
    assert all(pre.grad_worker_fraction == 0.5 for pre in kfac.preconditioners.values())
    out["layer_wise"] = [p.numpy() for p in run.params]
    return out


def test_two_optimizers_with_overlap_and_layer_wise_placement_on_two_processes_equal_one() -> None:
    from lightning_hpc.distributed import run_in_processes

    ref, _ = train_plain(reference=True)
    for out in run_in_processes(_ddp_overlap_run, 2, timeout_s=300, collective_timeout_s=60):
        assert out["late", True] == out["late", False] == []
        for a, b, lw, r in zip(out[True], out[False], out["layer_wise"], ref.parameters()):
            assert abs(a - b).max() <= 1e-12
            assert abs(lw - b).max() <= 1e-12
            assert abs(torch.from_numpy(b) - r).max() <= 1e-12  # two processes on halves: one on the global batch


class CompiledGan(LightningGan):
    """The GAN with each network compiled, as ``self.generator = torch.compile(...)`` writes it."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.generator = torch.compile(self.generator, backend=backend)  # type: ignore[assignment]
        self.discriminator = torch.compile(self.discriminator, backend=backend)  # type: ignore[assignment]


def test_compiled_networks_under_two_preconditioners_compile_as_without_kfac() -> None:
    """Each compiled network runs its compiled code on the steps neither preconditioner captures (the route of
    :mod:`lightning_hpc.kfac.compiled`, here over two preconditioners), and the fit equals the eager one."""
    from tests.kfac.test_kfac_compiled_route import Graphs

    options = {**OPTIONS, "factor_update_freq": 2}
    eager = fit(LightningGan(), loader(), max_epochs=1, callbacks=[KFAC(**options)])
    counts = {}
    for with_kfac in (False, True):
        torch._dynamo.reset()
        backend = Graphs()
        run = fit(CompiledGan(backend), loader(), max_epochs=1, callbacks=[KFAC(**options)] if with_kfac else [])
        counts[with_kfac] = backend.count
    assert_same_parameters(run.params, eager.params)
    assert counts[True] == counts[False] > 0, counts


def test_a_layer_two_optimizers_step_is_left_to_them_and_overlapping_preconditioners_are_refused() -> None:
    class SharedLayer(LightningGan):
        def configure_optimizers(self) -> Any:  # the generator's last layer in the discriminator's optimizer too
            g_opt, _ = optimizers(self)  # type: ignore[arg-type]
            both = [*self.discriminator.parameters(), *self.generator[2].parameters()]
            return [g_opt, torch.optim.SGD(both, lr=0.05)]

    kfac = KFAC(**OPTIONS)
    run = fit(SharedLayer(), loader(), max_epochs=1, callbacks=[kfac], record_warnings=True)
    assert [h.name for h in kfac.preconditioners[0].handlers] == ["generator.0"]
    assert [h.name for h in kfac.preconditioners[1].handlers] == ["discriminator.0", "discriminator.2"]
    assert run.warned("left to the optimizers, whose parameters several optimizers step: generator.2")
    # in a plain loop, preconditioners whose parameters overlap: the second is refused
    gan = Gan()
    KFACPreconditioner(gan, parameters=gan.generator.parameters(), announce=False)
    with pytest.raises(ValueError, match="'generator.2' .* already preconditioned by another KFACPreconditioner"):
        KFACPreconditioner(gan, parameters=[*gan.discriminator.parameters(), *gan.generator[2].parameters()],
                           announce=False)


@pytest.mark.parametrize("split", ["weight_in_both", "weight_and_bias_apart"])
def test_a_layer_whose_parameters_several_optimizers_step_is_named_once(split: str) -> None:
    """The generator's last layer with its weight in both optimizers and its bias in the generator's only, or its
    weight in one and its bias in the other: left to the optimizers and named once, in the line that says why, not
    also among either optimizer's left-out layers."""
    class SplitLayer(LightningGan):
        def configure_optimizers(self) -> Any:
            last = self.generator[2]
            g_params = [p for p in self.generator.parameters() if split == "weight_in_both" or p is not last.bias]
            d_params = [*self.discriminator.parameters(), last.weight if split == "weight_in_both" else last.bias]
            return [torch.optim.SGD(g_params, lr=0.05), torch.optim.SGD(d_params, lr=0.05)]

    kfac = KFAC(**OPTIONS)
    run = fit(SplitLayer(), loader(), max_epochs=1, callbacks=[kfac], record_warnings=True)
    assert [h.name for h in kfac.preconditioners[0].handlers] == ["generator.0"]
    assert [h.name for h in kfac.preconditioners[1].handlers] == ["discriminator.0", "discriminator.2"]
    assert all(name != "generator.2" for pre in kfac.preconditioners.values() for name, _, _ in pre.skipped_modules)
    reports = run.warned("left to the optimizers, whose parameters several optimizers step: generator.2")
    assert len(reports) == 1 and reports[0].count("generator.2") == 1, reports


def test_a_step_the_grad_scaler_skips_drops_only_its_optimizers_statistics() -> None:
    """16-mixed through K-FAC's precision plugin: a batch whose real samples overflow skips the discriminator's step
    (the scaler finds inf in its gradients); its preconditioner drops that step's statistics and does not count it,
    the generator's preconditioner steps as usual, and no factor holds a non-finite value."""
    from lightning_hpc import KFACMixedPrecision

    class Float32Gan(LightningGan):
        def __init__(self) -> None:
            super().__init__()
            self.float()

    zs, reals = zip(*batches())
    z, real = torch.cat(zs).float(), torch.cat(reals).float()
    real[16] = float("inf")  # the third batch
    kfac = KFAC(factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = fit(Float32Gan(), DataLoader(TensorDataset(z, real), batch_size=8), max_epochs=1, callbacks=[kfac],
                  plugins=[KFACMixedPrecision("16-mixed", device="cpu")])
    assert {i: pre.steps for i, pre in kfac.preconditioners.items()} == {0: STEPS, 1: STEPS - 1}
    assert all(bool(torch.isfinite(p).all()) for p in run.params)
    for pre in kfac.preconditioners.values():
        assert all(bool(torch.isfinite(f).all()) for fs in pre.factors.values() for f in fs.values())


def test_the_setup_report_is_said_once_per_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO):
        fit(LightningGan(), loader(), max_epochs=1, callbacks=[KFAC(**OPTIONS)])
    reports = [r.getMessage() for r in caplog.records if "K-FAC preconditions" in r.getMessage()]
    assert len(reports) == 1, reports  # not also the whole model's, built in setup before the optimizers existed
    assert reports[0].startswith("optimizer 0 (SGD): K-FAC preconditions 2 layer(s)")
    assert "optimizer 1 (SGD): K-FAC preconditions 2 layer(s)" in reports[0]

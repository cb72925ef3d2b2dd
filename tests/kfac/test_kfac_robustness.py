"""Bad batches, skipped steps, frozen biases, shared layers, sequence-first inputs, forgotten loss scales and the
setup report: each test fails on a preconditioner that lets the defect through."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _batch(seed: int, n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _pre(model: nn.Module, **kw) -> KFACPreconditioner:
    opts = {"factor_update_freq": 1, "inv_update_freq": 1, "damping": 0.1, "kl_clip": None}
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KFACPreconditioner(model, **opts)


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
    out = model(x)
    loss = F.cross_entropy(out, y) if weight is None else (out * weight).sum(1).mean()
    loss.backward()


def _factors(pre: KFACPreconditioner) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in f.items()} for n, f in pre.factors.items()}


def _assert_factors_equal(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys()
        for k in want[name]:
            torch.testing.assert_close(got[name][k], want[name][k], **tol)


# -- non-finite statistics ------------------------------------------------------------------------------------
def _nan_input(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x = x.clone()
    x[3, 2] = float("nan")
    return x, y, None


def _inf_output_grad(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.ones(x.shape[0], 4)
    w[1, 0] = float("inf")  # the output gradient of sample 1 is infinite: G would be
    return x, y, w


@pytest.mark.parametrize("corrupt", [_nan_input, _inf_output_grad], ids=["nan_activation", "inf_output_grad"])
def test_non_finite_statistics_never_enter_the_running_factors(corrupt):
    model = _mlp()
    ref_model = copy.deepcopy(model)
    pre, ref = _pre(model), _pre(ref_model)
    clean = [_batch(1), _batch(3)]
    bad = corrupt(*_batch(2))
    # the run sees clean, bad, clean, bad, clean; the reference only the clean batches (no optimizer steps: the
    # model is fixed, so only the statistics differ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate([clean[0], bad, clean[1], bad, clean[0]]):
            model.zero_grad()
            _backward(model, *batch)
            pre.step()
            if i == 1:
                bad_step_grads = [p.grad.clone() for p in model.parameters()]
    for x, y in [clean[0], clean[1], clean[0]]:
        ref_model.zero_grad()
        _backward(ref_model, x, y)
        ref.step()
    assert pre.dropped_statistics_steps == 2
    said = [w for w in caught if "non-finite" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # said once
    _assert_factors_equal(pre.factors, ref.factors, rtol=0, atol=0)
    for d in pre.decompositions.values():
        assert all(torch.isfinite(t).all() for t in d.values())
    assert any(not torch.isfinite(g).all() for g in bad_step_grads)  # the batch really was bad


@pytest.mark.parametrize("set_to_none", [True, False])
def test_statistics_of_a_step_without_step_call_do_not_survive(set_to_none):
    """forward/backward on a bad batch, the step skipped (zero_grad, no step()), then a clean batch: the factors
    are those of the clean batch alone."""
    model = _mlp()
    ref_model = copy.deepcopy(model)
    pre, ref = _pre(model), _pre(ref_model)
    x, y, _ = _nan_input(*_batch(2))
    _backward(model, x, y)
    model.zero_grad(set_to_none=set_to_none)  # the user skips this step (e.g. its loss was not finite)
    with torch.no_grad():
        model(x)  # and a forward that is never backpropagated
    model(_batch(5)[0])  # ... even with grad enabled
    x, y = _batch(1)
    _backward(model, x, y)
    pre.step()
    _backward(ref_model, x, y)
    ref.step()
    assert pre.dropped_statistics_steps == 0
    _assert_factors_equal(pre.factors, ref.factors, rtol=0, atol=0)


def test_gradient_accumulation_still_covers_every_micro_batch():
    """The stale-statistics rule keys on cleared gradients: accumulated micro-batches (gradients kept) all count."""
    model = _mlp()
    ref_model = copy.deepcopy(model)
    pre, ref = _pre(model), _pre(ref_model)
    x, y = _batch(1, n=12)
    for part in range(3):  # three micro-batches of a mean loss over 12 samples
        sl = slice(4 * part, 4 * part + 4)
        (F.cross_entropy(model(x[sl]), y[sl]) / 3).backward()
    pre.step()
    _backward(ref_model, x, y)
    ref.step()
    _assert_factors_equal(pre.factors, ref.factors, rtol=1e-5, atol=1e-6)


# -- frozen bias -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_frozen_bias_is_neither_preconditioned_nor_given_a_grad(kind):
    torch.manual_seed(0)
    if kind == "linear":
        layer, x = nn.Linear(5, 3), torch.randn(8, 5)
    else:
        layer, x = nn.Conv2d(2, 3, 3), torch.randn(8, 2, 5, 5)
    layer.bias.requires_grad_(False)
    nobias = copy.deepcopy(layer)
    nobias.bias = None  # the same weight without a bias parameter
    bias_before = layer.bias.clone()
    pre, ref = _pre(layer), _pre(nobias)
    for m, p in ((layer, pre), (nobias, ref)):
        out = m(x) if m is nobias else m(x) - layer.bias.view(-1, *([1] * (x.dim() - 2)))  # same output gradients
        (out.pow(2).mean()).backward()
        p.step()
    assert layer.bias.grad is None
    assert pre.handlers[0].a_dim == ref.handlers[0].a_dim  # no bias row in A
    torch.testing.assert_close(layer.weight.grad, nobias.weight.grad, rtol=1e-5, atol=1e-5)
    torch.optim.SGD(layer.parameters(), lr=1.0).step()
    assert torch.equal(layer.bias, bias_before)
    assert "bias frozen" in pre.describe_layers()


def test_frozen_weight_layer_is_left_to_the_optimizer_and_listed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    pre = _pre(model)
    assert [h.name for h in pre.handlers] == ["2"]
    assert "0 (Linear): weight frozen" in pre.describe_layers()


# -- a layer called twice per forward -------------------------------------------------------------------------------
class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        if x2 is None:  # x1 holds both inputs stacked along a position dimension: (N, 2, 5)
            return self.fc(x1).pow(2).sum(dim=(1, 2))
        return self.fc(x1).pow(2).sum(1) + self.fc(x2).pow(2).sum(1)


def test_layer_called_twice_counts_samples_once_per_forward():
    twice, stacked = Twice(), Twice()
    x1, x2 = torch.randn(7, 5), torch.randn(7, 5)
    pre, ref = _pre(twice), _pre(stacked)
    for micro in range(2):  # two accumulated micro-batches: each forward counts its 7 samples once
        (twice(x1 + micro, x2 - micro).mean() / 2).backward()
    with pytest.warns(UserWarning, match="more than once per forward"):
        pre.step()
    for micro in range(2):
        (stacked(torch.stack([x1 + micro, x2 - micro], dim=1)).mean() / 2).backward()
    ref.step()
    assert pre.handlers[0].max_calls_per_forward == 2
    _assert_factors_equal(pre.factors, ref.factors, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(twice.fc.weight.grad, stacked.fc.weight.grad, rtol=1e-5, atol=1e-6)


# -- sequence-first inputs
# -----------------------------------------------------------------------------------------------
def test_sequence_first_transformer_layer_equals_batch_first():
    """``TransformerEncoderLayer(batch_first=False)`` feeds its Linears ``(T, N, d)``: N is the sample dimension,
    so the factors equal those of the batch-first layer on the transposed input."""
    torch.manual_seed(0)
    seq_first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
    batch_first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    batch_first.load_state_dict(seq_first.state_dict())
    x = torch.randn(5, 3, 8)  # (T, N, d)
    pre, ref = _pre(seq_first), _pre(batch_first)
    seq_first(x).pow(2).sum(dim=(0, 2)).mean().backward()
    batch_first(x.transpose(0, 1)).pow(2).sum(dim=(1, 2)).mean().backward()
    assert pre.handlers[0].samples == 3  # N, not T
    pre.step()
    ref.step()
    # out_proj is used functionally by MultiheadAttention; the LayerNorms count samples on dim 1 as the Linears
    assert sorted(pre.factors) == ["linear1", "linear2", "norm1", "norm2"]
    assert {h.name: getattr(h, "batch_dim", 0) for h in pre.handlers} == {"linear1": 1, "linear2": 1, "norm1": 1,
                                                                          "norm2": 1}
    _assert_factors_equal(pre.factors, ref.factors, rtol=1e-5, atol=1e-6)
    assert "out_proj (NonDynamicallyQuantizableLinear): used functionally" in pre.describe_layers()


# -- fp16 with a GradScaler ----------------------------------------------------------------------------------------
def _fp16_step(pre_kw: dict, step_kw: dict, scale: float = 1024.0):
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = _pre(model, optimizer=opt, **{k: (scaler if v == "scaler" else v) for k, v in pre_kw.items()})
    x, y = _batch(1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    pre.step(**{k: (scaler.get_scale() if v == "scale" else v) for k, v in step_kw.items()})
    return pre


def test_fp16_without_the_loss_scale_is_refused():
    with pytest.raises(ValueError, match="grad_scaler=scaler"):
        _fp16_step({}, {})


def test_fp16_loss_scale_from_the_grad_scaler_equals_the_explicit_one():
    by_scaler = _fp16_step({"grad_scaler": "scaler"}, {})
    explicit = _fp16_step({}, {"grad_scale": "scale"})
    unscaled = _fp16_step({}, {"grad_scale": "scale"}, scale=1.0)
    _assert_factors_equal(by_scaler.factors, explicit.factors, rtol=0, atol=0)
    # the G of a scaled backward, unscaled, is the G of an unscaled one (fp16 rounding apart)
    _assert_factors_equal(by_scaler.factors, unscaled.factors, rtol=2e-2, atol=1e-4)


# -- the setup report -----------------------------------------------------------------------------------------------
def test_setup_says_which_modules_are_left_to_the_optimizer_and_why():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
        nn.Linear(4, 3), nn.Linear(3, 2), nn.Embedding(3, 2), nn.PReLU(),
    )
    model[5].requires_grad_(False)
    with pytest.warns(UserWarning) as caught:
        pre = KFACPreconditioner(model, skip_layers=["^4$"])
    text = "\n".join(str(w.message) for w in caught)
    assert ("K-FAC preconditions 4 layer(s):\n  0 (Conv2d)\n  1 (BatchNorm2d) [a 2x2 block per channel over scale and "
            "shift]\n  2 (Conv2d) [2 groups: a Kronecker block per group]\n  6 (Embedding) [diagonal A (token "
            "frequencies)]") in text
    assert "4 (Linear): matched skip_layers" in text
    assert "7 (PReLU): unsupported type" in text
    assert "5 (Linear)" not in text  # frozen entirely: nothing the optimizer trains
    assert pre.describe_layers() in text


# -- under the Lightning callback ------------------------------------------------------------------------------------
class _SkippingModule:
    """A LightningModule whose training_step skips (returns None) a batch with a non-finite loss."""

    @staticmethod
    def make(skip: bool):
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = _mlp()

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.cross_entropy(self.net(x), y)
                if skip and not torch.isfinite(loss):
                    return None  # Lightning skips backward and the optimizer step
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Module()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_callback_skipped_non_finite_batch_leaves_no_statistics(precision):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import KFAC
    from tests.fit_harness import fit

    xs = [_batch(s)[0] for s in range(4)]
    ys = [_batch(s)[1] for s in range(4)]
    bad_x = xs[1].clone()
    bad_x[0, 0] = float("nan")

    def train_on(x_list, y_list):
        kfac = KFAC(factor_update_freq=1, inv_update_freq=1, damping=0.1, kl_clip=None)
        module = _SkippingModule.make(skip=True)
        loader = DataLoader(TensorDataset(torch.cat(x_list), torch.cat(y_list)), batch_size=10, shuffle=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(module, loader, max_epochs=1, callbacks=[kfac], precision=precision)
        return kfac.preconditioner, module

    pre, module = train_on([xs[0], bad_x, xs[2], xs[3]], [ys[0], ys[1], ys[2], ys[3]])
    ref, ref_module = train_on([xs[0], xs[2], xs[3]], [ys[0], ys[2], ys[3]])
    assert pre.steps == ref.steps == 3
    _assert_factors_equal(pre.factors, ref.factors, rtol=0, atol=0)
    for a, b in zip(module.parameters(), ref_module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- KFAC + Adam: exact zeros stay exact, for any number of processes --------------------------------------------------
DEAD = [1, 4, 6]


def _dead_unit_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias[DEAD] = -100.0  # these units never activate: their rows of the gradient are exactly zero
    return model


def _adam_run(rank: int, world_size: int) -> list:

    model = _dead_unit_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(
            model, optimizer=opt, factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01
        )
    per = 16 // world_size
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
        average_gradients_like_ddp(model)  # the strategy's gradient allreduce
        pre.step()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_adam_zero_gradient_rows_stay_exact_for_one_and_two_processes():
    from lightning_hpc.distributed import run_in_processes

    start = [p.detach().clone() for p in _dead_unit_model().parameters()]
    one = [torch.from_numpy(p) for p in _adam_run(0, 1)]
    two = [
        [torch.from_numpy(p) for p in r] for r in run_in_processes(_adam_run, 2, timeout_s=180, collective_timeout_s=60)
    ]
    for params in (one, two[0], two[1]):
        w0, b0, w2 = params[0], params[1], params[2]
        assert torch.equal(w0[DEAD], start[0][DEAD]) and torch.equal(b0[DEAD], start[1][DEAD])  # dead rows untouched
        assert torch.equal(w2[:, DEAD], start[2][:, DEAD])  # the columns of their (zero) inputs as well
    for got, want in zip(two[0], one):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(one[0], start[0])  # the live units did train


def test_finiteness_check_of_the_factors_is_exact() -> None:
    """The factor step's finiteness check (2-norms first, one multi-tensor reduction) finds a NaN, +inf and -inf
    in any one tensor, and does not drop finite factors whose squares overflow (entries of 1e30 in float32: their
    norm is infinite, the entries are not)."""
    from lightning_hpc.kfac.factor_update import _all_finite

    def tensors() -> list[torch.Tensor]:
        return [torch.ones(3, 3), torch.zeros(0), torch.full((2, 2), 0.5, dtype=torch.float64)]

    assert _all_finite(tensors()) and _all_finite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 2):
            ts = tensors()
            ts[i][1, 1] = bad
            assert not _all_finite(ts), (bad, i)
    huge = tensors()
    huge[0][0, 0] = 1e30
    assert not bool(torch.isfinite(torch.linalg.vector_norm(huge[0])))  # the first test alone would drop it
    assert _all_finite(huge)
    huge[2][0, 0] = float("nan")
    assert not _all_finite(huge)


# -- backward passes that are not the loss's, or not only -----------------------------------------------------------
def _one_step_factors(net: nn.Module, loss_of) -> dict[str, dict[str, torch.Tensor]]:
    """The factors after one float64 step on a copy of ``net``, whose loss ``loss_of(model, pre)`` computes."""
    model = copy.deepcopy(net)
    pre = KFACPreconditioner(model, lr=0.1, announce=False, factor_dtype="float64", decomposition_dtype="float64")
    loss_of(model, pre).backward()
    pre.step()
    return pre.factors


def test_the_calls_a_gradient_penalty_differentiates_are_left_out_of_the_statistics():
    """R1 / WGAN-GP style: ``torch.autograd.grad`` of the critic's output with respect to its input, on the forward
    the loss also uses. That pass fires the layers' output-gradient hooks with the gradient of ``out.sum()`` (not of
    the loss) and gives the weights no gradient: the calls it reaches are left out, so every factor equals that of
    the same loss without the penalty whose penalised forward is not captured (float64). Counting the pass's
    gradient as the loss's made the last layer's G 64 times too large here (the gradient of a sum, not a mean)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()
    real, fake = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)

    def loss_of(penalty: bool):
        def loss(model: nn.Module, pre: KFACPreconditioner) -> torch.Tensor:
            x = real.clone().requires_grad_(True)
            with contextlib.nullcontext() if penalty else pre.capture_hooks.idle():
                out = model(x)
            loss = out.mean() - model(fake).mean()
            if penalty:
                (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                loss = loss + 10 * slope.square().sum(dim=1).mean()
            return loss
        return loss

    reference = _one_step_factors(critic, loss_of(False))
    assert sorted(reference) == ["0", "2"]
    _assert_factors_equal(_one_step_factors(critic, loss_of(True)), reference, rtol=0, atol=1e-13)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_captures_the_same_factors(use_reentrant):
    """``torch.utils.checkpoint`` recomputes the forward inside the backward pass (the reentrant variant in a
    backward pass of its own, which is the one that gives the weights their gradients): the factors equal those of
    the same step without checkpointing (float64)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    inp = x.clone().requires_grad_(use_reentrant)  # the reentrant variant needs an input that requires grad
    reference = _one_step_factors(net, lambda model, pre: F.mse_loss(model(inp), y))
    got = _one_step_factors(net, lambda model, pre: F.mse_loss(checkpoint(model, inp, use_reentrant=use_reentrant), y))
    assert sorted(reference) == ["0", "2"]
    _assert_factors_equal(got, reference, rtol=0, atol=1e-13)

"""Layer subclasses with a forward of their own, written here as model zoos write them (timm's ``Conv2dSame``,
``StdConv2d``, ``LayerNorm``, ``LayerNorm2d``, ``BatchNormAct2d``) and a ``weight_norm``-parametrized Linear: each is
either preconditioned exactly as the explicit model of what it computes (plain torch layers around the functional
op, float64, 1e-10) or left to the optimizer with the true reason, and the report lists exactly the layers whose
gradients ``step()`` changes."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn
from torch.nn.utils import parametrizations

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac import KFACPreconditioner

DAMPING = 0.03


def pad_same(x: torch.Tensor, kernel, stride, dilation) -> torch.Tensor:
    """TensorFlow's 'SAME' padding of a strided convolution: computed from the input size, the odd element last."""
    pads = [max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            for n, k, s, d in zip(x.shape[-2:], kernel, stride, dilation)]
    return F.pad(x, [pads[1] // 2, pads[1] - pads[1] // 2, pads[0] // 2, pads[0] - pads[0] // 2])


class Conv2dSame(nn.Conv2d):
    """timm's: pads in forward, then a convolution without padding."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, padding=0, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.weight.shape[-2:], self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class StdConv2d(nn.Conv2d):
    """timm's: the weight standardised in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ConvSameString(nn.Conv2d):
    """F.conv2d's own ``padding='same'`` (an even kernel: one more row and column on the far side)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, 1, "same", self.dilation)


class TanhConv(nn.Conv2d):
    """The base forward (reflect padding) followed by an activation: G is the convolution's, not the module's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


class GeluLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(x, self.weight, self.bias))


class LinearWithAux(nn.Linear):
    """A forward that returns its output with auxiliary values (a tuple holding a dict), as detection and
    multi-task heads do: the layer is followed through every tensor of the result."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.linear(x, self.weight, self.bias), {"input_mean": x.mean(), "steps": torch.ones(())}


class LayerNormT(nn.LayerNorm):
    """timm's LayerNorm: its own forward calling F.layer_norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class LayerNorm2d(nn.LayerNorm):
    """timm's: NCHW -> NHWC, F.layer_norm over channels, back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: F.batch_norm with the layer's running statistics, then an activation."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        training = True if self.training else (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, training, factor, self.eps)
        return self.act(x)


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class Head(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x).flatten(2).mean(-1) if x.dim() > 2 else torch.tanh(x))


def _same_pad_reference() -> nn.Module:
    return Lambda(lambda x: pad_same(x, (3, 3), (2, 2), (1, 1)))


#: name -> (the subclass model, the explicit model of what it computes); "body" is the layer under test
PAIRS = {
    "conv2d_same": (lambda: nn.Sequential(Conv2dSame(3, 4, 3, stride=2), Head(4)),
                    lambda: nn.Sequential(_same_pad_reference(), nn.Conv2d(3, 4, 3, stride=2), Head(4))),
    "conv_same_string": (lambda: nn.Sequential(ConvSameString(3, 4, 4, dilation=1), Head(4)),
                         lambda: nn.Sequential(nn.Conv2d(3, 4, 4, padding="same"), Head(4))),
    "conv_reflect_then_tanh": (lambda: nn.Sequential(TanhConv(3, 4, 3, padding=1, padding_mode="reflect"), Head(4)),
                               lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                                                     nn.Tanh(), Head(4))),
    "linear_then_gelu": (lambda: nn.Sequential(nn.Flatten(), GeluLinear(192, 5), Head(5)),
                         lambda: nn.Sequential(nn.Flatten(), nn.Linear(192, 5), nn.GELU(), Head(5))),
    "linear_with_aux_outputs": (lambda: nn.Sequential(nn.Flatten(), LinearWithAux(192, 5), Lambda(lambda out: out[0]),
                                                      Head(5)),
                                lambda: nn.Sequential(nn.Flatten(), nn.Linear(192, 5), Head(5))),
    "layernorm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), Lambda(lambda x: x.permute(0, 2, 3, 1)), LayerNormT(4),
                                        Lambda(lambda x: x.permute(0, 3, 1, 2)), Head(4)),
                  lambda: nn.Sequential(nn.Conv2d(3, 4, 1), Lambda(lambda x: x.permute(0, 2, 3, 1)), nn.LayerNorm(4),
                                        Lambda(lambda x: x.permute(0, 3, 1, 2)), Head(4))),
    "layernorm2d": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), LayerNorm2d(4), Head(4)),
                    lambda: nn.Sequential(nn.Conv2d(3, 4, 1), Lambda(lambda x: x.permute(0, 2, 3, 1)),
                                          nn.LayerNorm(4), Lambda(lambda x: x.permute(0, 3, 1, 2)), Head(4))),
    "batchnorm_act": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4), Head(4)),
                      lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.SiLU(), Head(4))),
}


def _kfac(model: nn.Module) -> KFACPreconditioner:
    return KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=1, kl_clip=None, damping=DAMPING,
                              decomposition_dtype="float64", factor_dtype="float64", announce=False)


def _step(model: nn.Module, pre: KFACPreconditioner, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("case", sorted(PAIRS))
def test_subclass_is_preconditioned_as_the_explicit_model(case, method):
    """Factors and preconditioned gradients of every layer equal those of the plain layers around the functional op
    (float64); before, Conv2dSame took A from the unpadded input (and the others G after their activation, or
    were left out with a reason about other ranks' statistics)."""
    make, make_reference = PAIRS[case]
    torch.manual_seed(0)
    model, reference = make().double(), make_reference().double()
    for p, q in zip(_trainable(model), _trainable(reference), strict=True):
        q.data.copy_(p.data)
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=1, kl_clip=None, damping=DAMPING,
                             compute_method=method, decomposition_dtype="float64", factor_dtype="float64",
                             announce=False)
    ref = KFACPreconditioner(reference, factor_update_freq=1, inv_update_freq=1, kl_clip=None, damping=DAMPING,
                             compute_method=method, decomposition_dtype="float64", factor_dtype="float64",
                             announce=False)
    assert len(pre.handlers) == len(ref.handlers)
    for seed in range(2):  # the running factors of two steps
        _step(model, pre, seed)
        _step(reference, ref, seed)
        for p, q in zip(_trainable(model), _trainable(reference), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    for h, r in zip(pre.handlers, ref.handlers, strict=True):
        for k, f in h.factors.items():
            torch.testing.assert_close(f, r.factors[k], rtol=1e-10, atol=1e-12, msg=lambda m, n=h.name: f"{n}: {m}")
    assert not pre.layer_report.pending and not pre.skipped_modules
    assert [n for n, *_ in pre.preconditioned_modules] == [h.name for h in pre.handlers]


class ScaledConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, 2.0 * self.weight, self.bias, self.stride, self.padding)


class ConvPlusPenalty(nn.Conv2d):
    """Calls F.conv2d on its own weight, and uses the weight once more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding) + 0.1 * self.weight.square().sum()


class LinearAndPenalty(nn.Linear):
    """Returns its output with a penalty on its weight (a tuple holding a dict): another use of the weight, found
    in the result's every tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.linear(x, self.weight, self.bias), {"penalty": 0.1 * self.weight.square().sum()}


class BiasAfterConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, self.stride, self.padding) + self.bias.view(1, -1, 1, 1)


class FrozenStatsBatchNorm(nn.BatchNorm2d):
    """Normalises with its running statistics while training (a frozen-statistics BatchNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class Mixed(nn.Module):
    """Every pattern at once, with plain layers between."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.same = Conv2dSame(4, 4, 3, stride=2)
        self.bnact = BatchNormAct2d(4)
        self.std = StdConv2d(4, 4, 3, padding=1)
        self.ln2d = LayerNorm2d(4)
        self.scaled = ScaledConv(4, 4, 1)
        self.penalty = ConvPlusPenalty(4, 4, 1)
        self.bias_after = BiasAfterConv(4, 4, 1)
        self.frozen_bn = FrozenStatsBatchNorm(4)
        self.plain_bn = nn.BatchNorm2d(4)
        self.wn = parametrizations.weight_norm(nn.Linear(4, 6))
        self.ln = LayerNormT(6)
        self.aux = LinearAndPenalty(6, 6)
        self.gelu = GeluLinear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bnact(self.same(torch.relu(self.stem(x))))
        h = self.ln2d(self.std(h))
        h = self.plain_bn(self.frozen_bn(self.bias_after(self.penalty(self.scaled(h)))))
        h, aux = self.aux(self.ln(self.wn(torch.tanh(h).mean((2, 3)))))
        return self.head(self.gelu(h + aux["penalty"]))


PRECONDITIONED = {"stem", "same", "bnact", "ln2d", "plain_bn", "ln", "gelu", "head"}
REASONS = {
    "std": "uses its weight and bias other than as the weight and bias of an F.conv2d call (autograd nodes "
           "ConvolutionBackward0, ViewBackward0)",
    "scaled": "uses its weight and bias other than as the weight and bias of an F.conv2d call",
    "penalty": "uses its weight other than as the weight of an F.conv2d call (autograd node PowBackward0)",
    "aux": "uses its weight other than as the weight of an F.linear call (autograd node PowBackward0)",
    "bias_after": "calls F.conv2d with a bias other than its trainable bias",
    "frozen_bn": "calls F.batch_norm with training=False, not the module's True",
    "wn": "its weight is computed from other parameters (parametrizations.weight.original0, "
          "parametrizations.weight.original1",
}


def test_report_lists_exactly_the_layers_whose_gradients_step_changes():
    torch.manual_seed(1)
    model = Mixed().double()
    pre = _kfac(model)
    # at setup: the weight_norm Linear is left out; no layer it cannot change is listed as preconditioned
    assert {n for n, *_ in pre.preconditioned_modules} == {"stem", "plain_bn", "head"}
    assert {n for n, *_ in pre.layer_report.pending} == PRECONDITIONED - {"stem", "plain_bn", "head"} | (
        set(REASONS) - {"wn"})
    assert "wn" in {n for n, *_ in pre.skipped_modules}
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 3, 9, 9, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=g)
        model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(model(x), y).backward()
            before = {n: [p.grad.clone() for p in m.parameters() if p.requires_grad]
                      for n, m in model.named_children()}
            pre.step()
        # each layer left out is said once, at the forward that showed it; nothing else is warned about
        said = sorted(str(w.message).split("'")[1] for w in caught if issubclass(w.category, RuntimeWarning))
        assert said == (sorted(set(REASONS) - {"wn"}) if step == 0 else []), [str(w.message) for w in caught]
        changed = {n for n, m in model.named_children()
                   if any(not torch.equal(p.grad, b) for p, b in zip([p for p in m.parameters() if p.requires_grad],
                                                                      before[n]))}
        assert {n for n, *_ in pre.preconditioned_modules} == changed == PRECONDITIONED
        assert not pre.layer_report.pending
        skipped = {n: why for n, _, why in pre.skipped_modules if "." not in n}
        assert set(skipped) == set(REASONS)
        for name, reason in REASONS.items():
            assert reason in skipped[name], (name, skipped[name])
    text = pre.describe_layers()
    assert "StdConv2d" in text and "decided at their first forward with gradients" not in text


def test_eval_and_no_grad_forwards_decide_nothing():
    """A BatchNormAct2d in eval mode (running statistics, training=False) is not refused for it, and a no-grad
    forward neither settles nor refuses a layer."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4), Head(4)).double()
    pre = _kfac(model)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    assert [n for n, *_ in pre.layer_report.pending] == ["1"]
    model.eval()
    model(x).sum().backward()  # grad-enabled eval forward: the call is the base class's, and nothing is captured
    assert [n for n, *_ in pre.preconditioned_modules] == ["0", "1", "2.fc"] and not pre.skipped_modules
    assert all(h.g_sum is None for h in pre.handlers)


def test_compiled_subclass_equals_the_explicit_model():
    """Under torch.compile the tracer's hooks still capture the padded input: the factors and gradients of the
    eager plain-torch model (F.pad + nn.Conv2d).  The eager backend: the hooks are a matter of graph capture, not
    of code generation (which would make the test wait for a C++ compiler)."""
    torch._dynamo.reset()
    make, make_reference = PAIRS["conv2d_same"]
    torch.manual_seed(2)
    model, reference = make().double(), make_reference().double()
    for p, q in zip(_trainable(model), _trainable(reference), strict=True):
        q.data.copy_(p.data)
    pre, ref = _kfac(model), _kfac(reference)
    compiled = torch.compile(model, backend="eager")
    try:
        for seed in range(2):
            _step(compiled, pre, seed)
            _step(reference, ref, seed)
    finally:
        torch._dynamo.reset()
    for p, q in zip(_trainable(model), _trainable(reference), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pre.factors["0"]["A"], ref.factors["1"]["A"], rtol=1e-10, atol=1e-12)
    assert [n for n, *_ in pre.preconditioned_modules] == ["0", "1.fc"]


class Double(nn.Module):
    def forward(self, b: torch.Tensor) -> torch.Tensor:
        return 2.0 * b


def test_parametrized_bias_is_left_to_the_optimizer_and_the_weight_block_is_exact():
    """A bias computed by a parametrization gets its gradient on the parametrization's parameter: the weight is
    preconditioned alone, as a Linear whose (same) bias is frozen; before, the computed bias was folded into A."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 5), Head(5)).double()
    reference = nn.Sequential(nn.Flatten(), nn.Linear(192, 5), Head(5)).double()
    reference.load_state_dict(model.state_dict())
    nn.utils.parametrize.register_parametrization(model[1], "bias", Double())
    with torch.no_grad():
        model[1].parametrizations.bias.original.copy_(reference[1].bias / 2)
    reference[1].bias.requires_grad_(False)
    pre, ref = _kfac(model), _kfac(reference)
    assert ("1", "ParametrizedLinear", "bias left to the optimizer") in pre.preconditioned_modules
    assert ("1.parametrizations.bias", "ParametrizationList",
            "the parameters from which a parametrization computes 1's 'bias'") in pre.skipped_modules
    for seed in range(2):
        _step(model, pre, seed)
        _step(reference, ref, seed)
        torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hook_computed_weights_are_left_out_at_setup():
    """The older weight_norm / spectral_norm hooks replace the weight parameter by ``weight_g``/``weight_v`` or
    ``weight_orig``: left out at setup with the parameters named (listed as preconditioned before)."""
    model = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 4)), nn.utils.spectral_norm(nn.Linear(4, 4)),
                          nn.Linear(4, 2))
    pre = _kfac(model)
    assert [n for n, *_ in pre.preconditioned_modules] == ["2"]
    skipped = {n: why for n, _, why in pre.skipped_modules}
    assert skipped["0"].startswith("its weight is computed from other parameters (weight_g, weight_v;")
    assert skipped["1"].startswith("its weight is computed from other parameters (weight_orig;")


def _train_mixed(rank: int, world: int, placement: str, overlap: bool) -> tuple[list, list[str]]:
    """4 steps of the mixed model on 8 samples: each of ``world`` ranks its share, one process the two halves as
    accumulated micro-batches (BatchNorm normalises each half alike)."""
    torch.manual_seed(5)
    model = Mixed().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=2, inv_update_freq=2, damping=DAMPING,
                             kl_clip=0.01, placement=placement, decomposition_dtype="float64",
                             factor_dtype="float64", overlap_factor_allreduce=overlap, announce=False)
    parts = 2 // world
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(8, 3, 9, 9, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        for j in range(parts):
            lo = (rank * parts + j) * 4
            context = pre.no_sync() if j < parts - 1 else contextlib.nullcontext()
            with context, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (F.cross_entropy(model(x[lo : lo + 4]), y[lo : lo + 4]) / parts).backward()
        average_gradients_like_ddp(model)
        pre.step()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()], [n for n, *_ in pre.preconditioned_modules]


MIXED_CASES = [("balanced", False), ("layer_wise", False), ("balanced", True)]


def _run_mixed(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {case: _train_mixed(rank, world, *case) for case in MIXED_CASES}


def test_two_processes_equal_one_process_on_the_mixed_model():
    """Every rank decides alike which subclasses it follows; 2 gloo processes (KAISA's layer_wise and the
    overlapped all-reduce included) equal one process (float64)."""
    one = _run_mixed(0, 1)
    for rank, res in enumerate(run_in_processes(_run_mixed, 2, timeout_s=300, collective_timeout_s=120)):
        for case in MIXED_CASES:
            assert set(res[case][1]) == set(one[case][1]) == PRECONDITIONED, (rank, case)
            for got, want in zip(res[case][0], one[case][0], strict=True):
                torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-9, atol=1e-10,
                                           msg=lambda m, case=case, rank=rank: f"{case} rank {rank}: {m}")

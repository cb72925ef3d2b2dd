"""K-FAC numerics against independent references: dense Kronecker solve, explicit inverses, factors recomputed
from recorded activations and output gradients, running averages, accumulation, KL clip (Eq 18)."""

from __future__ import annotations

import copy
import itertools
import math
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner, linalg

#: in the torch-range subset, run on the oldest and newest torch release (bash scripts/dev.sh torch-range)
pytestmark = pytest.mark.torch_range

LAYERS = {
    "linear_bias": lambda: nn.Linear(6, 5),
    "linear_nobias": lambda: nn.Linear(6, 5, bias=False),
    "conv_stride_pad_dil": lambda: nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2),
    "conv_nobias_stride": lambda: nn.Conv2d(3, 4, 2, stride=(2, 1), padding=(1, 0), bias=False),
    "conv_same_reflect": lambda: nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"),
    "conv1d_stride_pad_dil": lambda: nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2),
    "conv1d_same_circular": lambda: nn.Conv1d(3, 4, 3, padding="same", padding_mode="circular"),
    "conv3d_stride_pad_dil": lambda: nn.Conv3d(3, 4, 3, stride=(2, 1, 2), padding=(1, 2, 0), dilation=(1, 2, 1)),
    "conv3d_nobias_replicate": lambda: nn.Conv3d(3, 4, 2, padding=1, padding_mode="replicate", bias=False),
}
#: input extent per number of spatial dimensions (odd, unequal sides: a transposed axis would show)
EXTENT = {1: (11,), 2: (7, 7), 3: (6, 7, 5)}


def _inputs(layer: nn.Module, n: int = 6) -> torch.Tensor:
    return torch.randn(n, 6) if isinstance(layer, nn.Linear) else torch.randn(n, 3, *EXTENT[len(layer.kernel_size)])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # mean over samples (batch-averaged), non-trivial per-element weights
    return (out.flatten(1) * target).sum(1).pow(2).mean()


def _grad_matrix(layer: nn.Module) -> torch.Tensor:
    g = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    if layer.bias is not None:
        g = torch.cat([g, layer.bias.grad.reshape(-1, 1)], 1)
    return g


def _one_step(layer: nn.Module, **kw):
    x = _inputs(layer)
    out_shape = layer(x).shape
    target = torch.randn(out_shape[0], math.prod(out_shape[1:]))
    p = KFACPreconditioner(layer, inv_update_freq=1, factor_update_freq=1, kl_clip=None, **kw)
    layer.zero_grad()
    _loss(layer(x), target).backward()
    raw = _grad_matrix(layer).detach().double().clone()
    p.step()
    return p, raw, _grad_matrix(layer).detach().double()


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_eigen_equals_dense_kronecker_solve(name):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    damping = 0.05
    p, raw, got = _one_step(layer, damping=damping, decomposition_dtype=torch.float64)
    f = p.factors[""]
    a, g = f["A"].double(), f["G"].double()
    # (A kron G + damping I)^-1 vec(grad) with column-major vec == (G kron A + damping I)^-1 over row-major vec
    dense = torch.kron(g, a) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    want = torch.linalg.solve(dense, raw.reshape(-1)).reshape(raw.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("name", ["linear_bias", "conv_stride_pad_dil"])
def test_eigen_float32_close_to_dense_solve(name):
    torch.manual_seed(1)
    layer = LAYERS[name]()
    p, raw, got = _one_step(layer, damping=0.1)
    a, g = p.factors[""]["A"].double(), p.factors[""]["G"].double()
    dense = torch.kron(g, a) + 0.1 * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    want = torch.linalg.solve(dense, raw.reshape(-1)).reshape(raw.shape)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_inverse_method_equals_damped_inverses(name):
    torch.manual_seed(2)
    layer = LAYERS[name]()
    damping = 0.05
    p, raw, got = _one_step(layer, damping=damping, compute_method="inverse", decomposition_dtype=torch.float64)
    a, g = p.factors[""]["A"].double(), p.factors[""]["G"].double()
    want = torch.linalg.solve(g + damping * torch.eye(g.shape[0], dtype=torch.float64), raw)
    want = torch.linalg.solve(a + damping * torch.eye(a.shape[0], dtype=torch.float64), want.t()).t()  # A symmetric
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def _explicit_patches(x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """Rows of input patches by explicit slicing at every output position (no unfold), in any number of spatial
    dimensions: (N * T, C * prod(kernel)), ordered like ``weight.view(out, -1)``."""
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        xp = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    else:
        xp = F.pad(x, [p for p in reversed(conv.padding) for _ in range(2)])
    k, s, d = conv.kernel_size, conv.stride, conv.dilation
    out = [(xp.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(len(k))]
    rows = []
    for n in range(x.shape[0]):
        for pos in itertools.product(*(range(o) for o in out)):
            window = tuple(slice(p * s[i], p * s[i] + d[i] * (k[i] - 1) + 1, d[i]) for i, p in enumerate(pos))
            rows.append(xp[(n, slice(None), *window)].reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_factors_equal_independent_computation(name):
    torch.manual_seed(3)
    layer = LAYERS[name]().double()
    x = _inputs(layer).double()
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None)
    recorded = {}

    def keep(mod, inp, out):
        recorded["x"] = inp[0].detach().clone()
        out.retain_grad()
        recorded["out"] = out

    handle = layer.register_forward_hook(keep)
    out = layer(x)
    target = torch.randn(out.shape[0], math.prod(out.shape[1:]), dtype=torch.float64)
    _loss(out, target).backward()
    handle.remove()
    p.step()
    n = x.shape[0]
    if isinstance(layer, nn.Linear):
        rows_a = recorded["x"]
        rows_g = recorded["out"].grad
    else:
        rows_a = _explicit_patches(recorded["x"], layer)
        rows_g = recorded["out"].grad.movedim(1, -1).reshape(-1, layer.out_channels)
    if layer.bias is not None:
        rows_a = torch.cat([rows_a, torch.ones(rows_a.shape[0], 1, dtype=rows_a.dtype)], 1)
    a_ref = rows_a.t() @ rows_a / rows_a.shape[0]
    ds = n * rows_g  # per-sample loss gradients (the loss is a batch mean)
    g_ref = ds.t() @ ds / n
    torch.testing.assert_close(p.factors[""]["A"].double(), a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.factors[""]["G"].double(), g_ref, rtol=1e-5, atol=1e-6 * g_ref.abs().max().item())


GROUPED = {
    "conv2d_depthwise_multiplier": lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3),
    "conv1d_grouped_stride": lambda: nn.Conv1d(4, 6, 3, stride=2, groups=2),
    "conv3d_depthwise_nobias": lambda: nn.Conv3d(3, 3, 2, padding=1, padding_mode="reflect", groups=3, bias=False),
}


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_grouped_convolution_factors_and_solve_per_group(name):
    """A grouped / depthwise convolution is a Kronecker block per group, all groups in one handler: each group's
    block of the stacked A and G equals an independent computation on its input and output channels, and its
    preconditioned rows equal the dense solve of its block."""
    torch.manual_seed(4)
    layer = GROUPED[name]().double()
    x = torch.randn(5, layer.in_channels, *EXTENT[len(layer.kernel_size)], dtype=torch.float64)
    damping = 0.05
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=damping, decomposition_dtype="float64",
                           announce=False)
    assert [h.name for h in p.handlers] == [""]
    out = layer(x)
    out.retain_grad()
    target = torch.randn(out.shape[0], math.prod(out.shape[1:]), dtype=torch.float64)
    _loss(out, target).backward()
    raw = _grad_matrix(layer).detach().clone()
    p.step()
    got = _grad_matrix(layer)
    ci, co = layer.in_channels // layer.groups, layer.out_channels // layer.groups
    for i in range(layer.groups):
        rows_a = _explicit_patches(x[:, i * ci : (i + 1) * ci], layer)
        if layer.bias is not None:
            rows_a = torch.cat([rows_a, torch.ones(rows_a.shape[0], 1, dtype=rows_a.dtype)], 1)
        ds = x.shape[0] * out.grad[:, i * co : (i + 1) * co].movedim(1, -1).reshape(-1, co)
        a_ref, g_ref = rows_a.t() @ rows_a / rows_a.shape[0], ds.t() @ ds / x.shape[0]
        f = p.factors[""]
        torch.testing.assert_close(f["A"][i].double(), a_ref, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(f["G"][i].double(), g_ref, rtol=1e-7, atol=1e-9 * g_ref.abs().max().item())
        block = raw[i * co : (i + 1) * co]
        dense = torch.kron(g_ref, a_ref) + damping * torch.eye(a_ref.shape[0] * co, dtype=torch.float64)
        want = torch.linalg.solve(dense, block.reshape(-1)).reshape(block.shape)
        torch.testing.assert_close(got[i * co : (i + 1) * co], want, rtol=1e-6, atol=1e-8 * want.abs().max().item())


UNEQUAL_GROUPS = {
    "grouped": lambda: nn.Conv2d(6, 6, 3, padding=1, groups=3),
    "depthwise_multiplier_nobias": lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4, bias=False),
}


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("name", sorted(UNEQUAL_GROUPS))
def test_batched_groups_are_not_mixed(name, method):
    """The stacked blocks of a grouped layer stay apart in the batched factors, decompositions and products: with
    input and output channels whose scales differ by orders of magnitude, the whole layer's preconditioned
    gradient equals the one of independent per-group dense references (the block-diagonal Kronecker solve for the
    eigen method, ``(G_i + damping I)^-1 grad_i (A_i + damping I)^-1`` for the inverse one). The same references
    with two groups' blocks swapped are checked to be far off, so channels or groups taken from the wrong block
    would fail it."""
    torch.manual_seed(11)
    layer = UNEQUAL_GROUPS[name]().double()
    groups, n = layer.groups, 5
    in_scale = torch.logspace(-1.5, 1.5, layer.in_channels, dtype=torch.float64)[torch.randperm(layer.in_channels)]
    out_scale = torch.logspace(-2, 2, layer.out_channels, dtype=torch.float64)[torch.randperm(layer.out_channels)]
    x = torch.randn(n, layer.in_channels, 7, 7, dtype=torch.float64) * in_scale.view(1, -1, 1, 1)
    damping = 0.01
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=damping, compute_method=method,
                           decomposition_dtype="float64", factor_dtype="float64", announce=False)
    out = layer(x)
    out.retain_grad()
    target = (torch.randn(out.shape, dtype=torch.float64) * out_scale.view(1, -1, 1, 1)).reshape(n, -1)
    _loss(out, target).backward()
    raw = _grad_matrix(layer).detach().clone()
    p.step()
    got = _grad_matrix(layer)
    ci, co = layer.in_channels // groups, layer.out_channels // groups
    blocks = []
    for i in range(groups):
        rows_a = _explicit_patches(x[:, i * ci : (i + 1) * ci], layer)
        if layer.bias is not None:
            rows_a = torch.cat([rows_a, torch.ones(rows_a.shape[0], 1, dtype=rows_a.dtype)], 1)
        ds = n * out.grad[:, i * co : (i + 1) * co].movedim(1, -1).reshape(-1, co)
        blocks.append((rows_a.t() @ rows_a / rows_a.shape[0], ds.t() @ ds / n))

    def reference(order: list[int]) -> torch.Tensor:
        parts = []
        for i, j in enumerate(order):  # group i's gradient with group j's factors
            a, g = blocks[j]
            grad = raw[i * co : (i + 1) * co]
            if method == "eigen":
                dense = torch.kron(g, a) + damping * torch.eye(a.shape[0] * co, dtype=torch.float64)
                parts.append(torch.linalg.solve(dense, grad.reshape(-1)).reshape(grad.shape))
            else:
                eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(co, dtype=a.dtype)
                parts.append(torch.linalg.solve(g + damping * eye_g, grad) @ torch.linalg.inv(a + damping * eye_a))
        return torch.cat(parts)

    want = reference(list(range(groups)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9 * want.abs().max().item())
    swapped = reference([1, 0, *range(2, groups)])
    assert (swapped - want).abs().max() > 1e-2 * want.abs().max()


def test_silent_group_keeps_an_exactly_zero_weight_gradient():
    """Zero rows and columns of the gradient stay exactly zero block by block: a depthwise channel whose input is
    zero has a zero weight gradient (only its bias moves), and its preconditioned weight gradient is exactly zero
    though the other channels' columns are not."""
    torch.manual_seed(12)
    layer = nn.Conv2d(3, 3, 3, padding=1, groups=3)
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=0.01, announce=False)
    x = torch.randn(4, 3, 6, 6)
    x[:, 1] = 0.0
    _loss(layer(x), torch.randn(4, 3 * 36)).backward()
    assert torch.equal(layer.weight.grad[1], torch.zeros(1, 3, 3)) and layer.bias.grad[1] != 0
    p.step()
    assert torch.equal(layer.weight.grad[1], torch.zeros(1, 3, 3))
    assert layer.weight.grad[[0, 2]].ne(0).all() and layer.bias.grad.ne(0).all()


def test_checkpoint_with_a_layer_per_group_is_stacked():
    """A checkpoint that kept each group of a grouped convolution as a layer of its own (``<layer>#g<i>``) loads
    into the stacked blocks unchanged; one with only some of the groups is refused, naming the layer."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Flatten(), nn.Linear(64, 3))
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, announce=False)
    F.cross_entropy(model(torch.randn(5, 4, 4, 4)), torch.randint(0, 3, (5,))).backward()
    pre.step()
    state = pre.state_dict()
    per_group = copy.deepcopy(state)
    for key in ("factors", "decompositions"):
        whole = per_group[key].pop("0")
        per_group[key].update({f"0#g{i}": {k: v[i].clone() for k, v in whole.items()} for i in range(2)})
    other = KFACPreconditioner(copy.deepcopy(model), inv_update_freq=1, kl_clip=None, announce=False)
    other.load_state_dict(per_group)
    for key in ("factors", "decompositions"):
        for name, tensors in state[key].items():
            got = getattr(other, key)[name]
            assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    del per_group["factors"]["0#g1"]
    with pytest.raises(ValueError, match=r"grouped layer '0'.*0#g0"):
        KFACPreconditioner(copy.deepcopy(model), announce=False).load_state_dict(per_group)


def test_running_average_eq16_17():
    torch.manual_seed(4)
    layer = nn.Linear(4, 3)
    p = KFACPreconditioner(layer, inv_update_freq=1, factor_decay=0.9, kl_clip=None)
    seen = []
    for _ in range(3):
        x = torch.randn(5, 4)
        layer.zero_grad()
        layer(x).pow(2).sum(1).mean().backward()
        xa = torch.cat([x, torch.ones(5, 1)], 1)
        seen.append(xa.t() @ xa / 5)
        p.step()
    want = seen[0]
    for a in seen[1:]:
        want = 0.9 * want + 0.1 * a
    torch.testing.assert_close(p.factors[""]["A"], want, rtol=1e-5, atol=1e-6)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
    )


def test_accumulating_two_micro_batches_equals_one_double_batch():
    torch.manual_seed(5)
    base = _cnn()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    pres = [
        KFACPreconditioner(m, optimizer=o, inv_update_freq=2, factor_update_freq=1, damping=0.03, kl_clip=0.01)
        for m, o in zip(models, opts)
    ]
    for step in range(5):
        x, y = torch.randn(16, 2, 7, 7), torch.randint(0, 5, (16,))
        opts[0].zero_grad()
        F.cross_entropy(models[0](x), y).backward()
        opts[1].zero_grad()
        for half in (slice(0, 8), slice(8, 16)):
            (F.cross_entropy(models[1](x[half]), y[half]) / 2).backward()
        for p, o in zip(pres, opts):
            p.step()
            o.step()
    for name in pres[0].factors:
        for k in pres[0].factors[name]:
            torch.testing.assert_close(pres[1].factors[name][k], pres[0].factors[name][k], rtol=1e-5, atol=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_kl_clip_matches_eq18_by_hand():
    torch.manual_seed(6)
    base = _cnn()
    x, y = torch.randn(8, 2, 7, 7), torch.randint(0, 5, (8,))
    lr, kappa = 0.5, 1e-4
    out = {}
    for clip in (None, kappa):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        p = KFACPreconditioner(m, optimizer=opt, inv_update_freq=1, damping=0.01, kl_clip=clip)
        F.cross_entropy(m(x), y).backward()
        raw = {h.name: h.grad_matrix().clone() for h in p.handlers}
        p.step()
        out[clip] = (raw, {h.name: h.grad_matrix().clone() for h in p.handlers}, p.last_nu)
    raw, unclipped, _ = out[None]
    _, clipped, nu_got = out[kappa]
    vg = sum(abs(float((unclipped[n].double() * raw[n].double()).sum())) for n in raw)
    nu = min(1.0, math.sqrt(kappa / (lr**2 * vg)))
    assert nu < 1.0  # the test must exercise the clipping branch
    assert nu_got == pytest.approx(nu, rel=1e-5)
    for n in raw:
        torch.testing.assert_close(clipped[n], unclipped[n] * nu, rtol=1e-5, atol=1e-7)


def test_kl_clip_never_scales_up():
    """Eq 18's ``min(1, ...)``: where ``sqrt(kappa / vg)`` exceeds 1 (a large kappa, and a step with zero gradients,
    ``vg = 0``) the preconditioned gradients are left as they are, not scaled up."""
    torch.manual_seed(6)
    base = _cnn()
    x, y = torch.randn(8, 2, 7, 7), torch.randint(0, 5, (8,))
    lr, kappa = 0.5, 1e3
    out = {}
    for clip in (None, kappa):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        p = KFACPreconditioner(m, optimizer=opt, inv_update_freq=1, damping=0.01, kl_clip=clip, announce=False)
        F.cross_entropy(m(x), y).backward()
        raw = {h.name: h.grad_matrix().clone() for h in p.handlers}
        p.step()
        out[clip] = (raw, {h.name: h.grad_matrix().clone() for h in p.handlers}, p, m)
    raw, unclipped, _, _ = out[None]
    _, kept, pre, model = out[kappa]
    vg = sum(abs(float((unclipped[n].double() * raw[n].double()).sum())) for n in raw)
    assert math.sqrt(kappa / (lr**2 * vg)) > 1.0  # the test must exercise the min(1, ...) branch
    assert pre.last_nu == 1.0
    for n in raw:
        assert torch.equal(kept[n], unclipped[n]), n
    model.zero_grad()
    (model(x).sum() * 0.0).backward()  # a step with zero gradients: vg = 0, nu = 1
    pre.step()
    assert pre.last_nu == 1.0


def test_kl_clip_uses_each_layers_parameter_group_lr():
    """Eq 18 weighs each layer by the lr of the optimizer parameter group holding its weight; a layer whose weight
    is in no group, with no lr to fall back on, is refused by name."""
    torch.manual_seed(7)
    m, orphan = _cnn(), _cnn()
    x, y = torch.randn(8, 2, 7, 7), torch.randint(0, 5, (8,))
    opt = torch.optim.SGD([{"params": [m[0].weight], "lr": 2.0},
                           {"params": [q for q in m.parameters() if q is not m[0].weight], "lr": 0.1}])
    kappa = 1e-6
    p = KFACPreconditioner(m, optimizer=opt, inv_update_freq=1, damping=0.01, kl_clip=kappa, announce=False)
    F.cross_entropy(m(x), y).backward()
    raw = {h.name: h.grad_matrix().clone() for h in p.handlers}
    p.step()
    nu = p.last_nu
    assert nu < 1.0  # the test must exercise the clipping branch
    lrs = {"0": 2.0, "2": 0.1, "5": 0.1}
    vg = sum(lr**2 * abs(float((p.handlers[i].grad_matrix().double() / nu * raw[name].double()).sum()))
             for i, (name, lr) in enumerate(lrs.items()))
    assert nu == pytest.approx(math.sqrt(kappa / vg), rel=1e-5)
    opt = torch.optim.SGD([q for q in orphan.parameters() if q is not orphan[2].weight], lr=0.1)
    p = KFACPreconditioner(orphan, optimizer=opt, kl_clip=kappa, announce=False)
    F.cross_entropy(orphan(x), y).backward()
    with pytest.raises(ValueError, match="the weight of layer '2' is in none of the optimizer's parameter groups"):
        p.step()


def test_eigh_fallback_float64_then_jitter(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def flaky(x, *a, **k):
        calls.append(x.dtype)
        if len(calls) <= 2:  # the float32 attempt and the plain float64 retry fail
            raise torch.linalg.LinAlgError("forced failure")
        return real(x, *a, **k)

    monkeypatch.setattr(linalg.torch.linalg, "eigh", flaky)
    m = torch.randn(6, 6)
    sym = m @ m.t()
    with pytest.warns(RuntimeWarning, match="fallback"):
        res = linalg.safe_eigh(sym, torch.float32, "f")
    assert calls[:3] == [torch.float32, torch.float64, torch.float64]
    d, q = res
    assert d.dtype == torch.float32
    # jitter 1e-6 * mean diag: reconstruction is within that of the factor
    torch.testing.assert_close(q @ torch.diag(d) @ q.t(), sym, rtol=1e-4, atol=1e-4)


def test_eigh_total_failure_keeps_training(monkeypatch):
    def broken(x, *a, **k):
        raise torch.linalg.LinAlgError("always")

    monkeypatch.setattr(linalg.torch.linalg, "eigh", broken)
    layer = nn.Linear(4, 3)
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=0.5)
    layer(torch.randn(5, 4)).sum().backward()
    raw = layer.weight.grad.clone()
    with pytest.warns(RuntimeWarning, match="failed"):
        p.step()
    # identity factors: the step is a damped gradient step, finite
    torch.testing.assert_close(layer.weight.grad, raw / 1.5)


@pytest.mark.parametrize("use_blas", [True, False], ids=["syrk", "torch"])
@pytest.mark.parametrize("k_dims", [1, 3])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunks", "one_product"])
def test_sym_gram_equals_dense_product(monkeypatch, use_blas, k_dims, chunked):
    """The factor Gram (syrk upper triangle from chunks, the torch fallback used on CUDA, or the single product
    for small sides) equals rows^T rows in float64, on a strided view and with a partial last chunk; the column
    sums are the folded bias."""
    if use_blas and linalg._scipy_blas is None:
        pytest.skip("scipy not installed")
    if not use_blas:
        monkeypatch.setattr(linalg, "_scipy_blas", None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # syrk is only taken with one torch thread
    if chunked:
        monkeypatch.setattr(linalg, "GRAM_CHUNK_ELEMENTS", 200)  # several chunks, the last one partial
        monkeypatch.setattr(linalg, "SYRK_MIN_DIM", 1)  # syrk even for these small sides
    torch.manual_seed(5)
    t = torch.randn(7, 5, 9, 4, 3, dtype=torch.float64).permute(0, 3, 1, 4, 2)  # (N, 4, 5, 3, 9), not contiguous
    gram, colsum = linalg.sym_gram(t, k_dims=k_dims, colsum=True)
    rows = t.movedim(0, k_dims).reshape(math.prod(t.shape[1 : 1 + k_dims]), -1)
    torch.testing.assert_close(gram, rows @ rows.t(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(colsum, rows.sum(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k_dims", [1, 2])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunks", "one_product"])
def test_group_gram_equals_each_groups_product(monkeypatch, k_dims, chunked):
    """The block-diagonal Grams of a grouped layer (one batched product per chunk of samples) equal each group's
    ``rows rows^T`` in float64, on a strided view, with a partial last chunk; the column sums are the folded bias."""
    if chunked:
        monkeypatch.setattr(linalg, "GRAM_CHUNK_ELEMENTS", 300)  # two samples per chunk: 4 chunks, the last partial
    torch.manual_seed(8)
    t = torch.randn(7, 4, 3, 5, 2, dtype=torch.float64).permute(0, 2, 1, 4, 3)  # (N, G=3, 4, 2, 5), not contiguous
    if k_dims == 1:
        t = t.flatten(3)  # (N, G, k=4, P=10)
    gram, colsum = linalg.group_gram(t, k_dims=k_dims, colsum=True)
    expected = []
    for g in range(t.shape[1]):
        rows = t[:, g].movedim(0, k_dims).reshape(math.prod(t.shape[2 : 2 + k_dims]), -1)
        expected.append((rows @ rows.t(), rows.sum(1)))
    assert colsum is not None and gram.shape == (3, *expected[0][0].shape)
    for g, (gram_g, sums_g) in enumerate(expected):
        torch.testing.assert_close(gram[g], gram_g, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(colsum[g], sums_g, rtol=1e-12, atol=1e-12)


class _SyrkSpy:
    """Stands in for scipy's BLAS module: records syrk calls and delegates to the real one."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def call(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)

        return call


@pytest.mark.parametrize("threads", [1, 2])
def test_sym_gram_uses_syrk_only_with_one_torch_thread(monkeypatch, threads):
    """With several torch threads the Gram is torch's own product: scipy's OpenBLAS pool spinning beside torch's
    OpenMP pool made every K-FAC step ~10x slower at 2 threads on 2 cores. Same sums either way."""
    if linalg._scipy_blas is None:
        pytest.skip("scipy not installed")
    spy = _SyrkSpy(linalg._scipy_blas)
    monkeypatch.setattr(linalg, "_scipy_blas", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    t = torch.randn(64, 288, 40, dtype=torch.float64)  # k = 288 >= SYRK_MIN_DIM, several chunks
    gram, _ = linalg.sym_gram(t)
    rows = t.movedim(0, 1).reshape(288, -1)
    torch.testing.assert_close(gram, rows @ rows.t(), rtol=1e-12, atol=1e-9)
    assert (spy.calls > 0) == (threads == 1)


@pytest.mark.slow  # a wall-clock ratio: meaningful only on a machine with nothing else running (not the default tier)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to run torch on 2 threads")
def test_kfac_step_is_not_slowed_by_a_second_blas_pool():
    """Regression: a K-FAC factor step at 2 torch threads costs at most twice the 1-thread step (it was 7-8x:
    OpenBLAS and OpenMP thread pools oversubscribing the cores)."""
    before = torch.get_num_threads()

    def median_step_ms(threads: int) -> float:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(32, 64, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=5)
        x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[3:])

    try:
        one, two = median_step_ms(1), median_step_ms(2)
    finally:
        torch.set_num_threads(before)
    assert two <= 2.0 * one, f"K-FAC step {two:.1f} ms at 2 threads vs {one:.1f} ms at 1"


# -- optional variant: A of Conv2d layers from a random subset of each batch (tensorflow/kfac _SUB_SAMPLE_INPUTS) --
def _subsample_run(fraction: float, steps: int = 3, seed: int = 7):
    torch.manual_seed(seed)
    model = _cnn().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = KFACPreconditioner(
        model, optimizer=opt, inv_update_freq=2, damping=0.03, kl_clip=0.01, conv_input_sample_fraction=fraction
    )
    data = [(torch.randn(8, 2, 7, 7, dtype=torch.float64), torch.randint(0, 5, (8,))) for _ in range(steps)]
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return model, pre


@pytest.mark.parametrize("fraction", [1.0, 0.95])  # ceil(0.95 * 8) = 8: the subset is the whole batch
def test_conv_input_subset_of_whole_batch_is_the_full_computation(fraction):
    model_full, pre_full = _subsample_run(1.0)
    model_sub, pre_sub = _subsample_run(fraction)
    default = KFACPreconditioner(_cnn(), inv_update_freq=2)  # the option is off by default
    assert default.conv_input_sample_fraction == 1.0 and default.subsample_generator is None
    for name in pre_full.factors:
        for k in pre_full.factors[name]:
            assert torch.equal(pre_sub.factors[name][k], pre_full.factors[name][k])
    for a, b in zip(model_full.parameters(), model_sub.parameters()):
        assert torch.equal(a, b)


def test_conv_input_subset_factor_equals_reference_on_the_drawn_samples():
    """fraction 0.5 of 8 samples: each conv's A is the patch mean over the 4 samples the seeded generator draws
    (sorted randperm prefix), G and the Linear layer's A keep the whole batch."""
    torch.manual_seed(8)
    model = _cnn().double()
    ref = copy.deepcopy(model)
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, conv_input_sample_fraction=0.5, subsample_seed=3)
    full = KFACPreconditioner(ref, inv_update_freq=1, kl_clip=None)
    inputs = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Conv2d):
            mod.register_forward_hook(lambda m, i, o, name=name: inputs.__setitem__(name, i[0].detach().clone()))
    x, y = torch.randn(8, 2, 7, 7, dtype=torch.float64), torch.randint(0, 5, (8,))
    for m, p in ((model, pre), (ref, full)):
        F.cross_entropy(m(x), y).backward()
        p.step()
    gen = torch.Generator().manual_seed(3)
    for name in ("0", "2"):  # forward order: the generator draws for layer 0 first
        idx = torch.randperm(8, generator=gen)[:4].sort().values
        conv = dict(model.named_modules())[name]
        rows = _explicit_patches(inputs[name][idx], conv)
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
        a_ref = rows.t() @ rows / rows.shape[0]
        torch.testing.assert_close(pre.factors[name]["A"].double(), a_ref, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(pre.factors[name]["A"], full.factors[name]["A"], rtol=1e-3, atol=1e-4)  # a subset
        assert torch.equal(pre.factors[name]["G"], full.factors[name]["G"])  # G: the whole batch, as without it
    assert torch.equal(pre.factors["5"]["A"], full.factors["5"]["A"])  # Linear layers: the whole batch
    # a checkpoint carries the generator: a restored preconditioner draws the same subsets next
    state = pre.state_dict()
    other = KFACPreconditioner(copy.deepcopy(model), inv_update_freq=1, kl_clip=None, conv_input_sample_fraction=0.5)
    other.load_state_dict(state)
    assert torch.equal(other.subsample_generator.get_state(), pre.subsample_generator.get_state())


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, True])
def test_conv_input_sample_fraction_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="conv_input_sample_fraction"):
        KFACPreconditioner(_cnn(), conv_input_sample_fraction=bad)


def test_conv_input_subsampling_rejects_tiled_layers():
    from lightning_hpc.spatial.dispatch.kfac_contract import declare_tiled_convolutions

    tiled = nn.Sequential(nn.Conv2d(2, 3, 3))
    layers = declare_tiled_convolutions(tiled, 1)  # the strategy's registry of tiled layers (TiledConvHandler)
    with pytest.raises(ValueError, match="spatially tiled"):
        KFACPreconditioner(tiled, conv_input_sample_fraction=0.5, tiled_layers=layers)
    KFACPreconditioner(nn.Sequential(nn.Conv2d(2, 3, 3)), conv_input_sample_fraction=0.5)  # undeclared: accepted


def test_grouped_convolution_on_spatial_tiles_is_left_out_with_the_reason():
    """A grouped Conv2d among the spatial strategy's tiled layers has no tiled group statistics: it is left to the
    optimizer, and the report says why (not silently given untiled factors)."""
    from lightning_hpc.kfac.discovery import find_layers
    from lightning_hpc.spatial.dispatch.kfac_contract import TiledLayerRegistry

    tiled = nn.Conv2d(4, 4, 3, padding=1, groups=2)
    layers = TiledLayerRegistry(1).declare(nn.Sequential(tiled))
    report = find_layers(nn.Sequential(tiled, nn.Conv2d(4, 2, 1)), [], tiled=layers)
    assert [h.name for h in report.handlers] == ["1"]
    assert report.skipped == [("0", "Conv2d", "grouped convolution (groups=2) on spatial tiles is not supported")]


TRANSPOSED = {
    "convT1d_stride_outpad": lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
    "convT2d_unet_up": lambda: nn.ConvTranspose2d(3, 4, 2, stride=2),
    "convT2d_dilation_pad": lambda: nn.ConvTranspose2d(3, 2, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
    "convT3d_stride": lambda: nn.ConvTranspose3d(3, 2, (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 0), bias=False),
}


def _scatter_windows(gy: torch.Tensor, conv: nn.Module, in_extent: tuple[int, ...]) -> torch.Tensor:
    """Rows ``w_t`` (one per sample and *input* position) by explicit index arithmetic: the output gradient at
    ``t * stride - padding + k * dilation`` for every kernel offset (zero outside the output), ordered (C_out, *k)."""
    k, s, p, d = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    rows = []
    for n in range(gy.shape[0]):
        for t in itertools.product(*(range(e) for e in in_extent)):
            row = torch.zeros(gy.shape[1], *k, dtype=gy.dtype)
            for kk in itertools.product(*(range(kd) for kd in k)):
                o = tuple(t[i] * s[i] - p[i] + kk[i] * d[i] for i in range(len(k)))
                if all(0 <= o[i] < gy.shape[2 + i] for i in range(len(k))):
                    row[(slice(None), *kk)] = gy[(n, slice(None), *o)]
            rows.append(row.reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_transposed_convolution_factors_and_solve(name):
    """ConvTranspose1d/2d/3d: A from the input at the input positions, G from the output-gradient windows each
    input position scatters into (independent index arithmetic); the weight gradient is their product (the
    ordering), and the preconditioned gradient equals the dense Kronecker solve; the bias is left alone."""
    torch.manual_seed(5)
    layer = TRANSPOSED[name]().double()
    x = torch.randn(4, 3, *EXTENT[len(layer.kernel_size)], dtype=torch.float64)
    damping = 0.05
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=damping, decomposition_dtype="float64",
                           announce=False)
    out = layer(x)
    out.retain_grad()
    target = torch.randn(out.shape[0], math.prod(out.shape[1:]), dtype=torch.float64)
    _loss(out, target).backward()
    w_raw = layer.weight.grad.detach().clone()
    b_raw = None if layer.bias is None else layer.bias.grad.detach().clone()
    p.step()
    rows_a = x.movedim(1, -1).reshape(-1, 3)
    rows_g = _scatter_windows(out.grad, layer, tuple(x.shape[2:]))
    raw = w_raw.reshape(3, -1).t()  # (C_out * prod(k), C_in)
    torch.testing.assert_close(rows_g.t() @ rows_a, raw)  # dW = sum_t w_t x_t^T: the two sides' ordering
    n = x.shape[0]
    a_ref, g_ref = rows_a.t() @ rows_a / rows_a.shape[0], (n * rows_g).t() @ (n * rows_g) / n
    torch.testing.assert_close(p.factors[""]["A"].double(), a_ref, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(p.factors[""]["G"].double(), g_ref, rtol=1e-7, atol=1e-9 * g_ref.abs().max().item())
    dense = torch.kron(g_ref, a_ref) + damping * torch.eye(a_ref.shape[0] * g_ref.shape[0], dtype=torch.float64)
    want = torch.linalg.solve(dense, raw.reshape(-1)).reshape(raw.shape)
    got = layer.weight.grad.reshape(3, -1).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())  # as the dense tests
    if b_raw is not None:
        assert torch.equal(layer.bias.grad, b_raw)


GROUPED_TRANSPOSED = {
    "convT2d_groups2_stride": lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
    "convT1d_depthwise_dilation": lambda: nn.ConvTranspose1d(3, 3, 2, dilation=2, groups=3, bias=False),
    "convT3d_groups3": lambda: nn.ConvTranspose3d(3, 6, 2, stride=(1, 2, 1), groups=3),
}


@pytest.mark.parametrize("name", sorted(GROUPED_TRANSPOSED))
def test_grouped_transposed_convolution_block_per_group(name):
    """A grouped transposed convolution is a block per group: each group's A (its input channels) and G (the
    scatter windows of its output channels, by index arithmetic) equal an independent computation, and its rows of
    the weight gradient equal the dense solve of its own block (all groups stacked in one handler)."""
    torch.manual_seed(6)
    layer = GROUPED_TRANSPOSED[name]().double()
    x = torch.randn(4, layer.in_channels, *EXTENT[len(layer.kernel_size)], dtype=torch.float64)
    damping = 0.05
    p = KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=damping, decomposition_dtype="float64",
                           factor_dtype="float64", announce=False)
    assert [h.name for h in p.handlers] == [""]
    out = layer(x)
    out.retain_grad()
    target = torch.randn(out.shape[0], math.prod(out.shape[1:]), dtype=torch.float64)
    _loss(out, target).backward()
    w_raw = layer.weight.grad.detach().clone()
    p.step()
    ci, co, n = layer.in_channels // layer.groups, layer.out_channels // layer.groups, x.shape[0]
    for i in range(layer.groups):
        rows_a = x[:, i * ci : (i + 1) * ci].movedim(1, -1).reshape(-1, ci)
        rows_g = _scatter_windows(out.grad[:, i * co : (i + 1) * co], layer, tuple(x.shape[2:]))
        raw = w_raw[i * ci : (i + 1) * ci].reshape(ci, -1).t()
        torch.testing.assert_close(rows_g.t() @ rows_a, raw)  # the group's weight gradient: the sides' ordering
        a_ref, g_ref = rows_a.t() @ rows_a / rows_a.shape[0], (n * rows_g).t() @ (n * rows_g) / n
        f = p.factors[""]
        torch.testing.assert_close(f["A"][i], a_ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(f["G"][i], g_ref, rtol=1e-9, atol=1e-12 * g_ref.abs().max().item())
        dense = torch.kron(g_ref, a_ref) + damping * torch.eye(a_ref.shape[0] * g_ref.shape[0], dtype=torch.float64)
        want = torch.linalg.solve(dense, raw.reshape(-1)).reshape(raw.shape)
        got = layer.weight.grad[i * ci : (i + 1) * ci].reshape(ci, -1).t()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9 * want.abs().max().item())


@pytest.mark.parametrize("layer", [nn.ConvTranspose2d(2, 2, 2, stride=2), nn.Conv2d(2, 2, 3, padding=1, groups=2),
                                   nn.Conv2d(2, 2, 3, padding=1)],
                         ids=["transposed", "grouped", "undeclared_conv"])
def test_split_activation_into_a_layer_without_tiled_statistics_is_refused(layer):
    """Under the spatial strategy a layer's input is one tile of a split activation: a layer type whose K-FAC
    statistics have no tiled form, or a convolution the strategy did not declare tiled, is refused at the first
    capture, naming it and the fix, not given one tile's factors."""
    from lightning_hpc.spatial.dispatch import split_tensor
    from lightning_hpc.spatial.layout.tiling import SpatialGrid

    model = nn.Sequential(layer)
    KFACPreconditioner(model, inv_update_freq=1, announce=False)
    x = torch.randn(2, 2, 6, 6)
    model(x).sum().backward()  # a plain tensor: captured
    with pytest.raises(RuntimeError, match=r"K-FAC layer '0' .*skip_layers=\['0'\]"):
        model(split_tensor(x, SpatialGrid.single(), tuple(x.shape)))

"""Batched preconditioning (:mod:`lightning_hpc.kfac.batched`): layers whose gradients and decompositions have
equal shapes are preconditioned in one batched product chain per bucket, equal in float64 to each layer
preconditioned alone (1e-11 of the largest entry: a batched and a single matrix product round differently), on
every layer type, with the eigen and the inverse route; the stacked decompositions follow a decomposition update;
a negative control that mixes two layers of one bucket is caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.batched import PreconditionBuckets, _Stack, keep_zeros
from lightning_hpc.kfac.factor_update import update_factors


class _Zoo(nn.Module):
    """Pairs (and a triple) of layers of one type and shape, so each forms a bucket, beside layers with their own
    preconditioning: norms of 4 and 8 channels (one row concatenation), an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.g1, self.g2 = nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.d1 = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.t1, self.t2 = nn.ConvTranspose2d(4, 4, 3, padding=1), nn.ConvTranspose2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(4)
        self.ln_wide = nn.LayerNorm(8)
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.c3d = nn.Conv3d(4, 4, 1)

    def forward(self, idx):
        x = self.emb(idx).permute(0, 3, 1, 2)  # (N, 4, H, W)
        x = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        x = torch.tanh(self.g2(torch.tanh(self.g1(x))))
        x = self.gn(self.bn(self.t2(torch.tanh(self.t1(self.d1(x))))))
        x = self.c3d(x.unsqueeze(2)).squeeze(2)
        h = self.ln(x.mean((2, 3)))
        h = self.ln_wide(torch.cat([h, h.pow(2)], dim=1))[:, :4]
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(h)))))


def _fitted(method: str) -> tuple[_Zoo, KFACPreconditioner]:
    torch.manual_seed(0)
    model = _Zoo().double()
    p = KFACPreconditioner(model, inv_update_freq=1, factor_update_freq=1, kl_clip=None, damping=0.03,
                           compute_method=method, decomposition_dtype="float64", announce=False)
    for _ in range(2):
        model.zero_grad()
        model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
        p.step()
    model.zero_grad()
    model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
    return model, p


def _per_layer(p: KFACPreconditioner, grads):
    return {h.name: keep_zeros(h.preconditioned(grads[h.name], p.method, p.damping, torch.float64), grads[h.name])
            for h in p.handlers if h.name in grads}


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_batched_equals_per_layer(method):
    model, p = _fitted(method)
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    buckets = PreconditionBuckets()
    got = buckets.precondition(p.handlers, grads, p.method, p.damping, torch.float64)
    # a 1x1x1 Conv3d of 4 -> 4 channels has a Linear(4, 4)'s gradient and factor shapes: one bucket; the norm
    # layers' (scale, shift) rows are one concatenation whatever their channel counts
    assert sorted(map(sorted, buckets.last_buckets)) == [["bn", "gn", "ln", "ln_wide"], ["c1", "c2"],
                                                          ["c3d", "l1", "l2", "l3"], ["g1", "g2"],
                                                          ["t1", "t2"]], buckets.last_buckets
    want = _per_layer(p, grads)
    assert set(got) == set(want) == {h.name for h in p.handlers}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-11, atol=1e-11 * float(want[name].abs().max()))


def test_the_step_preconditions_through_the_buckets_and_follows_new_decompositions():
    """Through :meth:`KFACPreconditioner.step` twice (decompositions replaced in between): the gradients written
    back equal the per-layer products with the current decompositions."""
    model, p = _fitted("eigen")
    for _ in range(2):
        grads = {h.name: h.grad_matrix().clone() for h in p.handlers}
        update_factors(p, 1.0)
        p._update_decompositions()
        want = _per_layer(p, grads)
        p._precondition(None)
        for h in p.handlers:
            torch.testing.assert_close(h.grad_matrix(), want[h.name], rtol=1e-11,
                                       atol=1e-11 * float(want[h.name].abs().max()))
        model.zero_grad()
        model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
    assert p._buckets.last_buckets


def test_the_kept_damped_operands_follow_the_damping():
    """Eq 14's ``1 / (v_G v_A^T + damping)`` is kept with each bucket's stacked decompositions (one multiplication
    per step): a new damping (a damping schedule) is preconditioned with its own, equal to the per-layer products at
    that damping, on every bucket kind; reusing the kept ones at the old damping is caught (negative control)."""
    model, p = _fitted("eigen")
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    buckets = PreconditionBuckets()
    buckets.precondition(p.handlers, grads, p.method, 0.03, torch.float64)  # the reciprocals at 0.03 kept
    got = {k: v.clone() for k, v in buckets.precondition(p.handlers, grads, p.method, 0.5, torch.float64).items()}
    want = {h.name: keep_zeros(h.preconditioned(grads[h.name], p.method, 0.5, torch.float64), grads[h.name])
            for h in p.handlers}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-11, atol=1e-11 * float(want[name].abs().max()))
    for grp in buckets._plans["matrices"].groups:  # the negative control: the kept ones forced to the old damping
        if grp.stack is not None and grp.stack.damped is not None and "scale" in grp.stack.damped:
            grp.stack.damped = p.method.damped_operands(grp.stack.stacked, 0.03)
    stale_got = buckets.precondition(p.handlers, grads, p.method, 0.5, torch.float64)
    stale = max(float((stale_got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert stale > 1e-3, stale


def test_negative_control_mixed_layers_of_a_bucket_are_caught():
    """The same comparison with two layers' decompositions swapped inside a bucket's stack fails."""
    model, p = _fitted("eigen")
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    buckets = PreconditionBuckets()
    real = buckets._stacked

    def swapped(key, members, dtype, rows=False, **padding):
        stack = real(key, members, dtype, rows, **padding)
        # stacks: two layers swapped; row concatenations: the rows rolled by one channel across the layers
        shift = (lambda v: v.roll(1, 0)) if rows else (lambda v: v.flip(0))
        return _Stack(stack.sources, {k: shift(v) for k, v in stack.stacked.items()}, stack.layer_of_row,
                      stack.damping)

    buckets._stacked = swapped  # type: ignore[method-assign]
    got = buckets.precondition(p.handlers, grads, p.method, p.damping, torch.float64)
    want = _per_layer(p, grads)
    for names in (("c1", "l1"), ("bn", "ln_wide"), ("g1", "g2")):
        worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in names)
        assert worst > 1e-6, (names, worst)  # the comparisons above hold to 1e-11


def test_a_zero_column_of_one_norm_layer_stays_zero_in_the_concatenation():
    """keep_zeros per layer inside a row concatenation: a layer whose scale gradients are all exactly zero keeps
    them zero, while the other layers' scale column is preconditioned (a column zero only in the concatenation's
    rows of one layer is that layer's zero column)."""
    model, p = _fitted("eigen")
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    grads["gn"] = grads["gn"].clone()
    grads["gn"][:, 0] = 0.0
    got = PreconditionBuckets().precondition(p.handlers, grads, p.method, p.damping, torch.float64)
    want = _per_layer(p, grads)
    assert torch.equal(got["gn"][:, 0], torch.zeros(4, dtype=torch.float64))
    assert bool((got["bn"][:, 0] != 0).all())
    for name in ("bn", "gn", "ln", "ln_wide"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-11, atol=1e-11 * float(want[name].abs().max()))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_padded_buckets_on_accelerator_routes_equal_per_layer(method):
    """On an accelerator's routes, small layers of different shapes share a bucket padded to powers of two (zeros
    in the gradient, identity blocks in the factors): each layer's result, and its KL product, equals its own
    preconditioning's."""
    from lightning_hpc.kfac import linalg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 2),
                          nn.Tanh(), nn.Linear(2, 40)).double()
    p = KFACPreconditioner(model, inv_update_freq=1, factor_update_freq=1, kl_clip=None, damping=0.03,
                           compute_method=method, decomposition_dtype="float64", announce=False)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(16, 5, dtype=torch.float64)).pow(2).sum().backward()
        p.step()
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    buckets = PreconditionBuckets()
    with linalg.accelerator_routes():
        got = buckets.precondition(p.handlers, grads, p.method, p.damping, torch.float64, kl_terms=True)
    # (3, 6), (7, 4) and (2, 8) pad to (8, 8); (40, 3) alone in (64, 8)
    assert buckets.last_buckets == [["0", "2", "4"]], buckets.last_buckets
    want = _per_layer(p, grads)
    assert set(got) == set(want) == {"0", "2", "4", "6"}
    for name in want:
        assert got[name].shape == want[name].shape
        torch.testing.assert_close(got[name], want[name], rtol=1e-11, atol=1e-11 * float(want[name].abs().max()))
    products = {n: t for names, ts in buckets.last_kl_terms for n, t in zip(names, ts)}
    for name in want:
        torch.testing.assert_close(products[name], (want[name] * grads[name]).sum(), rtol=1e-11, atol=1e-14)
    # on the CPU's routes the same layers are preconditioned one by one
    cpu = PreconditionBuckets()
    cpu.precondition(p.handlers, grads, p.method, p.damping, torch.float64)
    assert cpu.last_buckets == []


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_depthwise_layers_of_different_widths_are_one_concatenation(method):
    """Depthwise convolutions of 4, 6 and 8 channels (groups of one shape) are preconditioned as one concatenation
    of their groups, each layer's result its own; a zero group stays zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Tanh(), nn.Conv2d(4, 6, 1), nn.Tanh(),
                          nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.Tanh(), nn.Conv2d(6, 8, 1), nn.Tanh(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8)).double()
    p = KFACPreconditioner(model, inv_update_freq=1, factor_update_freq=1, kl_clip=None, damping=0.03,
                           compute_method=method, decomposition_dtype="float64", announce=False)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(3, 4, 6, 6, dtype=torch.float64)).pow(2).sum().backward()
        p.step()
    grads = {h.name: h.grad_matrix() for h in p.handlers}
    grads["4"] = grads["4"].clone()
    grads["4"][2] = 0.0
    buckets = PreconditionBuckets()
    got = buckets.precondition(p.handlers, grads, p.method, p.damping, torch.float64, kl_terms=True)
    assert ["0", "4", "8"] in buckets.last_buckets, buckets.last_buckets
    assert torch.equal(got["4"][2], torch.zeros_like(got["4"][2]))
    want = _per_layer(p, grads)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-11, atol=1e-11 * float(want[name].abs().max()))
    products = {n: t for names, ts in buckets.last_kl_terms for n, t in zip(names, ts)}
    for name in want:
        torch.testing.assert_close(products[name], (want[name] * grads[name]).sum(), rtol=1e-11, atol=1e-14)


def test_the_kept_plan_follows_gradients_that_come_and_go():
    """The step's plan (buckets, buffers, views) is kept between steps: a layer whose weight has no gradient in a
    step is left alone, one whose bias has none gets the zero bias column of :meth:`grad_matrix`, and the next step
    with every gradient back preconditions every layer again, each equal to the per-layer product."""
    model, p = _fitted("eigen")
    for dropped, bias_only in ((("c1", "l2", "bn"), ("l1",)), ((), ()), (("g2",), ("c2", "ln"))):
        model.zero_grad()  # new .grad tensors every step (set_to_none)
        model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
        for name in dropped:
            getattr(model, name).weight.grad = getattr(model, name).bias.grad = None
        for name in bias_only:
            getattr(model, name).bias.grad = None
        grads = {h.name: h.grad_matrix().clone() for h in p.handlers if h.weight.grad is not None}
        want = _per_layer(p, grads)
        p._precondition(None)
        assert set(grads) == {h.name for h in p.handlers} - set(dropped)
        for h in p.handlers:
            if h.name in dropped:
                assert h.weight.grad is None and h.bias.grad is None
                continue
            torch.testing.assert_close(h.grad_matrix(), want[h.name], rtol=1e-11,
                                       atol=1e-11 * float(want[h.name].abs().max()))


def test_a_replaced_weight_is_preconditioned_from_the_next_factor_update_step():
    """The plan keeps the layers' weights; a weight replaced by another parameter object is re-read at the next
    factor-update step (every step here), whose preconditioning then rewrites the new parameter's gradient."""
    model, p = _fitted("eigen")
    old, model.l1.weight = model.l1.weight, nn.Parameter(model.l1.weight.detach().clone())
    old.grad = None  # the replaced parameter takes no more gradients
    model.zero_grad()
    model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
    raw = model.l1.weight.grad.clone()
    p.step()
    assert not torch.allclose(model.l1.weight.grad, raw)


def test_the_zero_mask_on_a_cpu_is_skipped_only_without_zero_entries():
    """On a CPU :func:`keep_zeros` first counts the gradient's zero entries: none (the usual case), nothing is
    masked; scattered zeros in no full row or column, nothing either; a zero row and a zero column, exactly those
    (in each block of a stack)."""
    from lightning_hpc.kfac.batched import _zero_mask

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(2, 5, 4, generator=gen) + 10.0  # no zero entry
    precond = torch.randn(2, 5, 4, generator=gen)
    assert _zero_mask(grad) is None
    assert torch.equal(keep_zeros(precond, grad), precond)
    grad[0, 1, 2] = grad[1, 3, 0] = 0.0  # scattered zeros
    assert not _zero_mask(grad).any()
    grad[1, 2, :] = 0.0  # a zero row of block 1
    grad[0, :, 3] = 0.0  # a zero column of block 0
    got = keep_zeros(precond, grad)
    want = precond.clone()
    want[1, 2, :] = 0.0
    want[0, :, 3] = 0.0
    assert torch.equal(got, want)

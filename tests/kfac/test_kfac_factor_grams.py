"""The cheaper factor statistics: a depthwise convolution's A from products of pairs of input rows
(``linalg.depthwise_patch_gram``) and a Linear layer's Grams without a copy (``linalg.sym_gram``'s row matrices),
against the Gram of the unfolded patches / the plain product in float64 (1e-12), and the factor step's finiteness
check (``factor_update._all_finite``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner, layers, linalg
from lightning_hpc.kfac.factor_update import _all_finite

# (N, C, H, W, kernel, stride, (top, bottom, left, right) zero padding, width dilation): ConvNeXt's and
# EfficientNet's layers (fewer samples), then odd ones: non-square kernels and images, asymmetric and no padding,
# padding beyond k - 1, stride along one side only, a kernel one row high, an image smaller than the kernel
SHAPES = [
    (3, 5, 16, 16, (7, 7), (1, 1), (3, 3, 3, 3), 1),
    (2, 6, 4, 4, (7, 7), (1, 1), (3, 3, 3, 3), 1),
    (3, 4, 9, 9, (5, 5), (2, 2), (2, 2, 2, 2), 1),
    (2, 3, 8, 9, (5, 3), (2, 1), (2, 1, 0, 1), 1),
    (2, 3, 5, 6, (3, 2), (1, 2), (0, 0, 0, 0), 2),
    (2, 2, 6, 6, (3, 3), (1, 1), (4, 3, 3, 4), 1),
    (2, 2, 6, 6, (1, 3), (1, 1), (0, 0, 1, 1), 1),
    (1, 2, 2, 2, (7, 7), (1, 1), (3, 3, 3, 3), 1),
    (2, 2, 7, 7, (4, 4), (3, 3), (2, 1, 1, 2), 1),
]


def _patch_gram(x: torch.Tensor, kernel, stride, padding, width_dilation) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the float64 Gram and sums of the unfolded patches (``F.unfold``), one row per sample and
    position, ordered like ``weight.view(C, -1)``."""
    top, bottom, left, right = padding
    cols = F.unfold(F.pad(x, (left, right, top, bottom)), kernel, dilation=(1, width_dilation), stride=stride)
    n, c = x.shape[:2]
    rows = cols.view(n, c, -1, cols.shape[-1]).permute(1, 0, 3, 2).reshape(c, -1, cols.shape[1] // c)
    return rows.mT @ rows, rows.sum(dim=1)


@pytest.mark.parametrize(("n", "c", "h", "w", "kernel", "stride", "padding", "dil"), SHAPES)
@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunk_per_channel"])
def test_depthwise_patch_gram_equals_the_patches_gram(monkeypatch, n, c, h, w, kernel, stride, padding, dil,
                                                      chunked):
    if chunked:  # every channel a chunk of its own
        monkeypatch.setattr(linalg, "GRAM_CHUNK_ELEMENTS", 1)
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    gram, sums = linalg.depthwise_patch_gram(x, kernel, stride, padding, dil, colsum=True)
    expected, expected_sums = _patch_gram(x, kernel, stride, padding, dil)
    assert gram.shape == expected.shape and sums is not None
    assert torch.equal(gram, gram.mT)  # exactly symmetric, as the symmetric allreduce needs
    scale = expected.abs().amax()
    assert float((gram - expected).abs().max() / scale) < 1e-12
    assert float((sums - expected_sums).abs().max() / expected_sums.abs().max()) < 1e-12


def test_depthwise_patch_gram_float32():
    """float32 input: the sums of the same products to float32 rounding of the largest entry."""
    torch.manual_seed(1)
    x = torch.randn(4, 6, 12, 12, dtype=torch.float64)
    gram, _ = linalg.depthwise_patch_gram(x.float(), (7, 7), (1, 1), (3, 3, 3, 3))
    expected, _ = _patch_gram(x, (7, 7), (1, 1), (3, 3, 3, 3), 1)
    assert gram.dtype == torch.float32
    assert float((gram.double() - expected).abs().max() / expected.abs().max()) < 2e-6


LAYERS = {
    "convnext_7x7": lambda: nn.Conv2d(4, 4, 7, padding=3, groups=4),
    "stride2_nobias": lambda: nn.Conv2d(4, 4, 5, stride=2, padding=2, groups=4, bias=False),
    "multiplier": lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3),
    "reflect": lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3, padding_mode="reflect"),
    "circular_asym": lambda: nn.Conv2d(3, 3, (3, 5), padding=(1, 2), groups=3, padding_mode="circular"),
    "same_even": lambda: nn.Conv2d(3, 3, 4, padding="same", groups=3),
    "width_dilation": lambda: nn.Conv2d(3, 3, 3, padding=(1, 2), dilation=(1, 2), groups=3),
}


@pytest.mark.parametrize("unbatched", [False, True])
@pytest.mark.parametrize("layer", list(LAYERS), ids=list(LAYERS))
def test_depthwise_handler_takes_row_pairs_exactly(monkeypatch, layer, unbatched):
    """GroupConvHandler.input_gram (bias folded, unbatched input, any padding mode) through the row pairs equals
    the unfolded patches' batched Gram in float64."""
    torch.manual_seed(2)
    conv = LAYERS[layer]().double()
    handler = layers.GroupConvHandler("conv", conv)
    x = torch.randn(3, conv.in_channels, 9, 10, dtype=torch.float64)
    x = x[0] if unbatched else x
    assert handler._row_pairs(x)
    got, rows = handler.input_gram(x)
    monkeypatch.setattr(layers.GroupConvHandler, "_row_pairs", lambda self, x: False)
    expected, expected_rows = handler.input_gram(x)
    assert rows == expected_rows and got.shape == expected.shape
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-12


@pytest.mark.parametrize("conv", [nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4), nn.Conv2d(4, 4, 3, groups=2),
                                  nn.Conv1d(4, 4, 3, groups=4)], ids=["height_dilation", "grouped", "conv1d"])
def test_other_grouped_layers_keep_the_patches(conv):
    x = torch.randn(2, 4, 8, 8) if isinstance(conv, nn.Conv2d) else torch.randn(2, 4, 8)
    assert not layers.GroupConvHandler("conv", conv)._row_pairs(x)


def test_kfac_step_factors_equal_with_and_without_row_pairs(monkeypatch):
    """One factor step of a float64 ConvNeXt-style block gives the depthwise layer the same factors through the row
    pairs as through the patches (1e-12 of the largest entry)."""

    def factors(row_pairs: bool) -> dict[str, dict[str, torch.Tensor]]:
        if not row_pairs:
            monkeypatch.setattr(layers.GroupConvHandler, "_row_pairs", lambda self, x: False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 2, stride=2), nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.GELU(),
                              nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, bias=False), nn.Flatten(),
                              nn.Linear(8 * 16, 4)).double()  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1)
        x, y = torch.randn(5, 3, 16, 16, dtype=torch.float64), torch.randint(0, 4, (5,))
        F.cross_entropy(model(x), y).backward()
        pre.step()
        return pre.factors

    new, old = factors(True), factors(False)
    assert new.keys() == old.keys() and {"1", "3"} <= set(old)
    for name in old:
        for k in old[name]:
            scale = float(old[name][k].abs().max())
            torch.testing.assert_close(new[name][k], old[name][k], rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize(("n", "k"), [(300, 130), (100, 130), (8192, 40), (129, 1280 // 5), (7, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_matrix_gram_equals_the_product(n, k, threads):
    """A contiguous row matrix (a Linear layer's inputs) through syrk or one product, at one and two threads:
    ``t^T t`` and the column sums in float64."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(3)
        t = torch.randn(n, k, dtype=torch.float64)
        gram, sums = linalg.sym_gram(t, colsum=True)
    finally:
        torch.set_num_threads(before)
    expected = t.t() @ t
    assert sums is not None and torch.allclose(sums, t.sum(dim=0), rtol=1e-12, atol=1e-12)
    assert float((gram - expected).abs().max() / expected.abs().max()) < 1e-12


def test_all_finite_sees_every_nan_and_infinity():
    """The factor step's one-sync check: a NaN, +inf or -inf anywhere in any tensor (also where a vectorised
    reduction's tail is), and not a large finite value."""
    ts = [torch.randn(37, 37), torch.randn(3, 50, 50, dtype=torch.float64), torch.randn(1000)]
    assert _all_finite(ts)
    assert _all_finite([torch.full((5, 5), 3e38)])  # their sum would overflow; they are finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i, t in enumerate(ts):
            for pos in (0, t.numel() // 2, t.numel() - 1):
                broken = [x.clone() for x in ts]
                broken[i].view(-1)[pos] = bad
                assert not _all_finite(broken), (bad, i, pos)


class _EveryType(nn.Module):
    """A Linear, a convolution, a depthwise and a grouped convolution, a BatchNorm and an Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.dw = nn.Conv2d(6, 6, 5, padding=2, groups=6)
        self.grouped = nn.Conv2d(6, 4, 3, groups=2, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).permute(0, 3, 1, 2)  # (N, 3, 5, 5)
        return self.fc(self.bn(self.grouped(self.dw(self.conv(x)))).flatten(1))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_precondition_flops_count_the_products_the_step_runs(method):
    """Each layer's FLOP model equals what torch's FLOP counter counts in its preconditioning (the matrix products
    of Eq 13-15 / Eq 12 or of the layer's own form), for every layer type; the inverse route's two products are
    half the eigen route's four."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_hpc.kfac.methods import make_method

    torch.manual_seed(0)
    model = _EveryType()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, compute_method=method)
    F.cross_entropy(model(torch.randint(0, 7, (4, 5, 5))), torch.randint(0, 5, (4,))).backward()
    pre.step()
    assert {type(h).__name__ for h in pre.handlers} >= {"LinearHandler", "ConvHandler", "GroupConvHandler",
                                                         "NormAffineHandler", "EmbeddingHandler"}
    for h in pre.handlers:
        grad = h.grad_matrix()
        assert grad is not None
        with FlopCounterMode(display=False) as counter:
            h.preconditioned(grad, pre.method, pre.damping, pre.decomposition_dtype)
        assert h.precondition_flops(pre.method) == counter.get_total_flops() > 0, h.name
        if method == "eigen":
            assert h.precondition_flops(make_method("inverse")) * 2 == h.precondition_flops(pre.method)


def _output_factor(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """G of a Linear layer fed 4096 rows whose output gradients have magnitude about ``scale`` (as a ConvNeXt
    block's branch gets behind its layer scale after some training)."""
    torch.manual_seed(0)
    fc = nn.Linear(16, 8).to(dtype)
    pre = KFACPreconditioner(fc, factor_update_freq=1, inv_update_freq=1, announce=False)
    g = torch.Generator().manual_seed(1)
    out = fc(torch.randn(4096, 16, generator=g, dtype=dtype))
    out.backward(torch.randn(out.shape, generator=g, dtype=dtype) * scale)
    (handler,) = pre.handlers
    return handler.batch_factors()[1].double()


def _unscaled(fn):
    """``fn()`` with the output gradients' Grams formed as they come (no scaling into the normal range)."""
    scaled = layers.base.unit_scaled  # type: ignore[attr-defined]
    layers.base.unit_scaled = lambda t: (t, 1.0)  # type: ignore[attr-defined]
    try:
        return fn()
    finally:
        layers.base.unit_scaled = scaled  # type: ignore[attr-defined]


def test_tiny_output_gradients_are_scaled_into_the_normal_range_before_their_gram():
    """Output gradients of about ``1e-21``: their products (about ``1e-42``) would be subnormal float32 numbers,
    which x86 CPUs compute one to two orders of magnitude more slowly (a ConvNeXt-style network's factor step took
    3.5x as long).  The Gram is formed from the gradients scaled by a power of two into ``[1, 2)``
    (``linalg.unit_scaled``).  (G's raw sums here are subnormal themselves, about ``1e-39``: float32 keeps a
    few digits of them either way; ``float64`` factors, ``factor_dtype='float64'``, keep all.)"""
    seen: list[float] = []
    real = layers.LinearHandler.output_gram

    def spy(self, g):
        seen.append(float(g.abs().max()))
        return real(self, g)

    layers.LinearHandler.output_gram = spy  # type: ignore[method-assign]
    try:
        _output_factor(torch.float32, 1e-21)
    finally:
        layers.LinearHandler.output_gram = real  # type: ignore[method-assign]
    assert len(seen) == 1 and 1.0 <= seen[0] < 2.0, seen


def test_output_factor_scaled_exactly_where_no_product_is_subnormal():
    """At ``1e-12`` (products about ``1e-24``: normal, but below the guard, so the gradients are scaled) the
    scaled factor equals the unscaled one bit for bit: a power of two scales exactly."""
    assert torch.equal(_output_factor(torch.float32, 1e-12), _unscaled(lambda: _output_factor(torch.float32, 1e-12)))


def test_unit_scaled_leaves_accelerator_routes_and_normal_tensors_alone():
    t = torch.full((4, 3), 1e-30)
    scaled, unscale = linalg.unit_scaled(t)
    assert 1.0 <= float(scaled.abs().max()) < 2.0 and torch.equal(scaled * unscale**0.5, t)
    with linalg.accelerator_routes():  # a GPU computes subnormals at full speed: nothing read or scaled
        assert linalg.unit_scaled(t) == (t, 1.0)
    for plain in (torch.randn(4, 3), torch.zeros(4, 3), t.double()):
        assert linalg.unit_scaled(plain)[0] is plain

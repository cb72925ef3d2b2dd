"""A of stride-1 convolutions from channel correlations (``linalg.conv_patch_gram``) against the plain Gram
``X^T X`` of the unfolded patches, in float64 and float32, at ResNet-32's shapes and at odd ones; the handler
takes it only where it applies, and a K-FAC step's factors are the same with it and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner, layers, linalg

# (N, C, H, W, kernel, padding): ResNet-32's three stages (fewer samples), then odd sizes: non-square images and
# kernels, no / partial / full (k - 1) padding, 'same' with an even kernel (asymmetric), images smaller than
# the kernel, a single row
SHAPES = [
    (3, 16, 32, 32, 3, 1),
    (3, 32, 16, 16, 3, 1),
    (5, 64, 8, 8, 3, 1),
    (4, 3, 7, 5, 3, 1),
    (2, 5, 6, 9, 3, 0),
    (3, 4, 5, 5, 5, 2),
    (2, 3, 6, 6, 3, 2),
    (2, 3, 6, 6, 5, 1),
    (2, 3, 4, 6, (3, 2), (1, 0)),
    (2, 2, 3, 9, (1, 5), (0, 2)),
    (2, 3, 7, 8, 4, "same"),
    (3, 2, 2, 2, 5, 3),
    (2, 2, 1, 3, 3, 1),
]


def _patch_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The unfolded patches, one row per output position, ordered like ``weight.view(out, -1)``."""
    pads = conv._reversed_padding_repeated_twice
    cols = F.unfold(F.pad(x, pads), conv.kernel_size)  # (N, C kh kw, positions)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    left, right, top, bottom = conv._reversed_padding_repeated_twice
    return top, bottom, left, right


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("n", "c", "h", "w", "kernel", "padding"), SHAPES)
def test_conv_patch_gram_equals_dense_product(dtype, n, c, h, w, kernel, padding):
    torch.manual_seed(3)
    conv = nn.Conv2d(c, 2, kernel, padding=padding, bias=False)
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    rows = _patch_rows(conv, x)
    expected = rows.t() @ rows  # float64 reference
    got = linalg.conv_patch_gram(x.to(dtype), conv.kernel_size, _padding(conv))
    assert got.dtype == dtype
    assert torch.equal(got, got.t())  # exactly symmetric, as the symmetric allreduce needs
    # float32: summation-order rounding of sums of ~N H W products, relative to the largest entry
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    scale = expected.abs().max()
    assert float((got.double() - expected).abs().max() / scale) < tol


def test_conv_patch_gram_of_a_strided_input():
    """Any input strides (a channels-last or sliced activation): the result does not depend on the layout."""
    torch.manual_seed(4)
    x = torch.randn(3, 9, 10, 6, dtype=torch.float64)[:, ::2].contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(5, 2, 3, padding=1, bias=False)
    rows = _patch_rows(conv, x)
    torch.testing.assert_close(linalg.conv_patch_gram(x, (3, 3), (1, 1, 1, 1)), rows.t() @ rows, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("unbatched", [False, True])
def test_conv_handler_uses_correlations_exactly(monkeypatch, bias, unbatched):
    """ConvHandler.input_gram (bias folded, unbatched input) equals the unfolded path's sums in float64."""
    monkeypatch.setattr(layers.conv, "SHIFTED_GRAM_MIN_WORK", 0)
    torch.manual_seed(5)
    conv = nn.Conv2d(4, 3, 3, padding=1, bias=bias).double()
    handler = layers.ConvHandler("conv", conv)
    x = torch.randn(6, 4, 9, 7, dtype=torch.float64)
    x = x[0] if unbatched else x
    assert handler._shifted_padding(x) == (1, 1, 1, 1)
    got, rows = handler.input_gram(x)
    handler.shifted_gram = False
    expected, expected_rows = handler.input_gram(x)
    assert rows == expected_rows
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.Conv2d(8, 8, 3, padding=2, dilation=2),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(8, 8, 3, padding=3),
        nn.Conv2d(8, 8, 1),
    ],
    ids=["stride", "dilation", "reflect", "padding_over_k-1", "1x1"],
)
def test_conv_handler_keeps_patches_where_correlations_do_not_apply(monkeypatch, conv):
    monkeypatch.setattr(layers.conv, "SHIFTED_GRAM_MIN_WORK", 0)
    assert layers.ConvHandler("conv", conv)._shifted_padding(torch.randn(2, 8, 9, 9)) is None


def test_resnet_layers_take_correlations_and_small_layers_do_not():
    """At the default threshold: ResNet-32's 3x3 layers at batch 128 take the correlations, a small layer the
    single product of its patches."""
    big = layers.ConvHandler("big", nn.Conv2d(64, 64, 3, padding=1, bias=False))
    small = layers.ConvHandler("small", nn.Conv2d(3, 8, 3, padding=1))
    assert big._shifted_padding(torch.empty(128, 64, 8, 8)) == (1, 1, 1, 1)
    assert small._shifted_padding(torch.empty(8, 3, 8, 8)) is None


def test_kfac_factors_equal_with_and_without_correlations(monkeypatch):
    """One factor step of a small CNN (biased and bias-free 3x3 layers, zero padding 0 and 1) gives the same
    float32 factors through the correlations as through the unfolded patches, to float32 rounding."""

    def factors(shifted: bool) -> dict[str, dict[str, torch.Tensor]]:
        monkeypatch.setattr(layers.conv, "SHIFTED_GRAM_MIN_WORK", 0 if shifted else 1 << 62)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, bias=False), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1)
        x, y = torch.randn(16, 3, 10, 10), torch.randint(0, 4, (16,))
        F.cross_entropy(model(x), y).backward()
        pre.step()
        return pre.factors

    new, old = factors(True), factors(False)
    assert new.keys() == old.keys()
    for name in old:
        for k in old[name]:
            scale = float(old[name][k].abs().max())
            torch.testing.assert_close(new[name][k], old[name][k], rtol=0, atol=2e-6 * scale)

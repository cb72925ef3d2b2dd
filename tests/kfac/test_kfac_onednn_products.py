"""Eq 13-15's products through oneDNN on a CPU (:func:`lightning_hpc.kfac.linalg.precondition_eigen`): large float32
chains run matrix by matrix as 1x1 convolutions, equal to torch's BLAS chain and to the float64 computation within
float32's rounding; the route is taken where it applies (the profiler sees oneDNN's convolution) and not elsewhere;
the batched and the per-layer preconditioning agree bit for bit on it, also after the decompositions are replaced
(the eigenvectors' kept transposes follow them); ``torch.backends.mkldnn.flags(enabled=False)`` turns it off, and a
CPU without AVX-512 (where oneDNN gains nothing over MKL) keeps BLAS. The tests but the last one take the route on
any CPU: they check its sums and where it applies, not its speed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_hpc.kfac import KFACPreconditioner, linalg
from lightning_hpc.kfac.batched import PreconditionBuckets, keep_zeros
from lightning_hpc.kfac.factor_update import update_factors
from lightning_hpc.kfac.linalg import (
    ONEDNN_GRAM_MAX_ROWS_PER_COLUMN,
    ONEDNN_MIN_MACS,
    precondition_eigen,
    product,
    sym_gram,
)

pytestmark = [
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
    pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN"),  # torch's, from mkldnn.flags()
]


@pytest.fixture(autouse=True)
def _route_on_any_cpu(request, monkeypatch):
    if request.function is not test_the_route_is_taken_only_where_the_cpu_runs_onednn_wider_than_blas:
        monkeypatch.setattr(linalg, "onednn_outruns_blas", lambda: True)


def _operands(g_dim: int, a_dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qg = torch.linalg.qr(torch.randn(g_dim, g_dim, generator=gen, dtype=torch.float64))[0]
    qa = torch.linalg.qr(torch.randn(a_dim, a_dim, generator=gen, dtype=torch.float64))[0]
    dg = torch.rand(g_dim, generator=gen, dtype=torch.float64)
    da = torch.rand(a_dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(g_dim, a_dim, generator=gen, dtype=torch.float64)
    return grad, qa, da, qg, dg


def _convolutions(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = {e.key: e.count for e in prof.key_averages()}
    # a one-image convolution torch does not give oneDNN runs its slow reference kernel: never taken
    assert "aten::slow_conv_dilated2d" not in events, events
    return events.get("aten::mkldnn_convolution", 0)


def test_the_onednn_chain_equals_blas_and_float64_within_rounding():
    ops64 = _operands(384, 257)  # 384 * 384 * 257 multiply-adds: above the route's threshold
    assert 384 * 384 * 257 >= ONEDNN_MIN_MACS
    ops32 = [t.float() for t in ops64]
    want = precondition_eigen(*ops64, 0.01)
    got = precondition_eigen(*ops32, 0.01)
    with torch.backends.mkldnn.flags(enabled=False):
        blas = precondition_eigen(*ops32, 0.01)
    scale = float(want.abs().max())
    err_route = float((got.double() - want).abs().max()) / scale
    err_blas = float((blas.double() - want).abs().max()) / scale
    assert err_route < 1e-5 and err_blas < 1e-5, (err_route, err_blas)
    assert not torch.equal(got, blas)  # two kernels, two roundings: the comparison above is between routes
    # the kept transposes give the same chain bit for bit
    grad, qa, da, qg, dg = ops32
    torch.testing.assert_close(precondition_eigen(grad, qa, da, qg, dg, 0.01, qa.mT.contiguous(),
                                                  qg.mT.contiguous()), got, rtol=0, atol=0)


def test_the_route_is_taken_where_it_applies_and_only_there():
    big = [t.float() for t in _operands(384, 257)]
    small = [t.float() for t in _operands(64, 65)]
    assert _convolutions(lambda: precondition_eigen(*big, 0.01)) == 4
    assert _convolutions(lambda: precondition_eigen(*small, 0.01)) == 0
    assert _convolutions(lambda: precondition_eigen(*[t.double() for t in big], 0.01)) == 0
    with torch.backends.mkldnn.flags(enabled=False):
        assert _convolutions(lambda: precondition_eigen(*big, 0.01)) == 0
    # each product decides: a squeeze-and-excitation layer's 48 x 1153 chain takes the route for its two products
    # with Q_A (1153^2 x 48 multiply-adds each), BLAS for the two small ones with Q_G; a classifier's 10 x 1281 chain
    # for its first product only (the last one's 10 x 1281 image is one torch would not give oneDNN)
    for (g_dim, a_dim), convs in (((48, 1153), 2), ((10, 1281), 1)):
        ops64 = _operands(g_dim, a_dim)
        ops32 = [t.float() for t in ops64]
        assert _convolutions(lambda: precondition_eigen(*ops32, 0.01)) == convs, (g_dim, a_dim)
        want = precondition_eigen(*ops64, 0.01)
        assert float((precondition_eigen(*ops32, 0.01).double() - want).abs().max() / want.abs().max()) < 1e-5
    # a stack of two: one chain per matrix
    stacked = [torch.stack([t, t.flip(0)]) for t in big]
    got = precondition_eigen(*stacked, 0.01)
    assert _convolutions(lambda: precondition_eigen(*stacked, 0.01)) == 8
    for i in range(2):
        torch.testing.assert_close(got[i], precondition_eigen(*[s[i] for s in stacked], 0.01), rtol=0, atol=0)


class _Pair(nn.Module):
    """Two Linear layers of one shape (one bucket) large enough for the route, and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(256, 384), nn.Linear(256, 384)
        self.head = nn.Linear(384, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(x)) * torch.tanh(self.l2(x)))


def _batch(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(512, 256, generator=gen)).pow(2).sum().backward()


def test_batched_equals_per_layer_bit_for_bit_and_follows_new_decompositions():
    torch.manual_seed(0)
    model = _Pair()
    p = KFACPreconditioner(model, inv_update_freq=1, factor_update_freq=1, kl_clip=None, damping=0.03,
                           announce=False)
    for step in range(3):
        _batch(model, step)
        update_factors(p, 1.0)
        p._update_decompositions()  # new eigenvectors: the bucket's stack and its transposes are rebuilt
        grads = {h.name: h.grad_matrix().clone() for h in p.handlers}
        buckets = p._buckets
        got = buckets.precondition(p.handlers, grads, p.method, p.damping, torch.float32)
        assert ["l1", "l2"] in buckets.last_buckets
        stack = next(s for s in buckets._stacks.values() if s.stacked["q_A"].dim() == 3)
        assert torch.equal(stack.stacked["qT_G"], stack.stacked["q_G"].mT)
        for h in p.handlers:
            want = keep_zeros(h.preconditioned(grads[h.name], p.method, p.damping, torch.float32), grads[h.name])
            torch.testing.assert_close(got[h.name], want, rtol=0, atol=0)
    assert _convolutions(lambda: PreconditionBuckets().precondition(p.handlers, grads, p.method, p.damping,
                                                                    torch.float32)) == 8


def test_linear_grams_take_the_route_where_syrk_does_not():
    """A Linear layer's Gram (:func:`~lightning_hpc.kfac.linalg.sym_gram` of its row matrix) with fewer than twice
    as many rows as columns, or on several threads, runs through oneDNN, equal to the float64 Gram within
    float32's rounding; a tall one with BLAS syrk or BLAS (its convolution would have few pixels for a long sum)."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(384, 640, generator=gen)
    want = wide.double().t() @ wide.double()
    got, sums = sym_gram(wide, colsum=True)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    torch.testing.assert_close(sums, wide.sum(0))
    assert _convolutions(lambda: sym_gram(wide)) == 1
    tall = torch.randn(ONEDNN_GRAM_MAX_ROWS_PER_COLUMN * 160 + 1, 160, generator=gen)
    assert _convolutions(lambda: sym_gram(tall)) == 0


def test_the_inverse_routes_products_take_the_route_matrix_by_matrix():
    """:func:`~lightning_hpc.kfac.linalg.product` (Eq 12's products) on a stack of two: one oneDNN call per matrix,
    equal to the float64 product within float32's rounding; a small one stays with BLAS."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 384, 384, generator=gen), torch.randn(2, 384, 257, generator=gen)
    want = x.double() @ w.double()
    assert float((product(x, w).double() - want).abs().max() / want.abs().max()) < 1e-6
    assert _convolutions(lambda: product(x, w)) == 2
    assert _convolutions(lambda: product(x[:, :64, :64], w[:, :64, :65])) == 0


def test_trainer_fit_of_lightnings_boring_model_takes_the_route_and_equals_blas(monkeypatch):
    """``Trainer.fit`` of Lightning's ``BoringModel`` with a wider body (the ``KFAC`` callback): in float32 its
    preconditioning goes through oneDNN (the calls are counted), and the trained weights are as close to the same
    fit in float64 as the float32 fit on torch's BLAS is, within 4x (K-FAC amplifies float32 rounding: the bound the
    matrix's float32 K-FAC cells use)."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_hpc import KFAC
    from lightning_hpc.kfac import linalg

    class WideBoring(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 2))

        def forward(self, x):
            return self.layer(x.to(self.layer[0].weight.dtype))

    calls = []
    real = linalg._onednn_mm_t
    monkeypatch.setattr(linalg, "_onednn_mm_t", lambda x, wt: calls.append(1) or real(x, wt))

    def fit(dtype: torch.dtype) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = WideBoring().to(dtype)
        trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[KFAC(factor_update_freq=1, inv_update_freq=2,
                                             decomposition_dtype="float64" if dtype == torch.float64 else "float32")])
        trainer.fit(model)
        return [p.detach().double() for p in model.parameters()]

    routed = fit(torch.float32)
    assert calls, "no product went through oneDNN"
    calls.clear()
    with torch.backends.mkldnn.flags(enabled=False):
        blas = fit(torch.float32)
    assert not calls
    exact = fit(torch.float64)  # decompositions and products in float64 too: BLAS
    assert not calls

    def dist(ps: list[torch.Tensor]) -> float:
        return max(float((p - e).abs().max()) for p, e in zip(ps, exact, strict=True))

    assert dist(routed) <= 4 * dist(blas), (dist(routed), dist(blas))


@pytest.mark.parametrize(("capability", "vendor", "family", "convs"), [
    ("AVX2", "AuthenticAMD", 26, 0), ("DEFAULT", "AuthenticAMD", 26, 0), ("AVX512", "AuthenticAMD", 26, 4),
    ("AVX512", "AuthenticAMD", 27, 4), ("AVX512", "AuthenticAMD", 25, 0), ("AVX512", "AuthenticAMD", None, 0),
    ("AVX512", "GenuineIntel", 6, 0), ("AVX2", "GenuineIntel", 6, 0), ("AVX512", "", 26, 0)])
def test_the_route_is_taken_only_where_the_cpu_runs_onednn_wider_than_blas(
        monkeypatch, capability, vendor, family, convs):
    """oneDNN's route where torch reports AVX-512 on an AMD CPU with full-width 512-bit units (family 26 on: MKL
    runs 256-bit code there); BLAS on AVX2-only CPUs, on Zen 4 (family 25, 512-bit instructions in two halves), on
    Intel's AVX-512 CPUs, where MKL runs code as wide as oneDNN's, and where the vendor or family is unknown."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(linalg, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linalg, "cpu_family", lambda: family)
    linalg.onednn_outruns_blas.cache_clear()
    try:
        big = [t.float() for t in _operands(384, 257)]
        assert _convolutions(lambda: precondition_eigen(*big, 0.01)) == convs
        assert linalg.keeps_transposes(big[1]) == (convs > 0)
    finally:
        linalg.onednn_outruns_blas.cache_clear()


def test_the_cpu_vendor_is_the_one_the_operating_system_reports():
    info = Path("/proc/cpuinfo")
    lines = [ln for ln in info.read_text(errors="replace").splitlines() if ln.startswith("vendor_id")] \
        if info.exists() else []
    if not lines:
        pytest.skip("no vendor_id in /proc/cpuinfo on this system")
    assert linalg.cpu_vendor() == lines[0].partition(":")[2].strip() != ""


def test_the_cpu_family_is_the_one_the_operating_system_reports():
    info = Path("/proc/cpuinfo")
    lines = [ln for ln in info.read_text(errors="replace").splitlines() if ln.startswith("cpu family")] \
        if info.exists() else []
    if not lines:
        assert linalg.cpu_family() is None
        return
    assert linalg.cpu_family() == int(lines[0].partition(":")[2]) > 0

"""Storage dtypes (``factor_dtype``, ``inverse_dtype``): the accuracy each costs, measured
against the dense solve ``(A (x) G + gamma I)^-1 vec(grad)`` with float64 running factors, and the default
unchanged (bitwise the preconditioner without the options)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner

DAMPING = 0.01
STEPS = 4  # running averages over several batches (factor_decay 0.8): the storage rounding accumulates
# Measured relative errors (linear 20->12 / conv 3->8 3x3, eigen): default 1.0e-5 / 1.7e-5; inverse_dtype bfloat16
# 8.3e-3 / 7.3e-3, float16 1.3e-3 / 1.9e-3; factor_dtype float16 3.6e-2 / 1.6e-2, bfloat16 0.44 / 0.17.


def _layer(name: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(20, 12) if name == "linear" else nn.Conv2d(3, 8, 3, padding=1)


def _batch(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 20, generator=g) if name == "linear" else torch.randn(16, 3, 6, 6, generator=g)


def _grad_matrix(layer: nn.Module) -> torch.Tensor:
    return torch.cat([layer.weight.grad.reshape(layer.weight.shape[0], -1), layer.bias.grad.reshape(-1, 1)], 1)


def _run(name: str, **kw) -> tuple[KFACPreconditioner, torch.Tensor, torch.Tensor]:
    """STEPS factor + decomposition steps on fixed parameters (no optimizer: every run sees the same gradients);
    returns the preconditioner, the last raw gradient matrix and its preconditioned version."""
    layer = _layer(name)
    pre = KFACPreconditioner(layer, factor_update_freq=1, inv_update_freq=1, damping=DAMPING, factor_decay=0.8,
                             kl_clip=None, announce=False, **kw)  # fmt: skip
    for step in range(STEPS):
        layer.zero_grad()
        out = layer(_batch(name, step))
        (out.flatten(1).sin().sum(1) ** 2).mean().backward()
        raw = _grad_matrix(layer).detach().double().clone()
        pre.step()
    return pre, raw, _grad_matrix(layer).detach().double()


def _operator(a: torch.Tensor, g: torch.Tensor, method: str) -> torch.Tensor:
    """The dense matrix each method inverts: ``A (x) G + gamma I`` (eigen, Eq 13-15) or ``(A + gamma I) (x)
    (G + gamma I)`` (inverse, Eq 11-12), over the row-major vec of the ``(g_dim, a_dim)`` gradient."""
    if method == "inverse":
        eye_a, eye_g = (torch.eye(m.shape[0], dtype=torch.float64) for m in (a, g))
        return torch.kron(g + DAMPING * eye_g, a + DAMPING * eye_a)
    return torch.kron(g, a) + DAMPING * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)


def _dense_solve(pre: KFACPreconditioner, raw: torch.Tensor, method: str) -> torch.Tensor:
    a, g = pre.factors[""]["A"].double(), pre.factors[""]["G"].double()
    return torch.linalg.solve(_operator(a, g, method), raw.reshape(-1)).reshape(raw.shape)


#: unit roundoff (half the machine epsilon) of the storage dtypes
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _norm2(m: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(m, 2))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("name", ["linear", "conv"])
def test_storage_dtype_accuracy_against_the_dense_solve(name, method):
    exact, raw, _ = _run(name, factor_dtype="float64", decomposition_dtype="float64", compute_method=method)
    a, g = exact.factors[""]["A"], exact.factors[""]["G"]
    want = _dense_solve(exact, raw, method)

    # float64 statistics and decompositions are the dense solve (up to the float32 .grad they are written to)
    _, _, got = _run(name, factor_dtype="float64", decomposition_dtype="float64", compute_method=method)
    assert _relative_error(got, want) < 1e-7
    # the default: float32 statistics, factors and decompositions (measured 0.3e-5 .. 1.8e-5)
    pre, _, got = _run(name, compute_method=method)
    assert pre.factors[""]["A"].dtype == torch.float32 and all(
        v.dtype == torch.float32 for v in pre.decompositions[""].values()
    )
    base = _relative_error(got, want)
    assert base < 5e-5

    for dtype in (torch.bfloat16, torch.float16):
        # inverse_dtype: decompositions rounded once to the storage dtype; measured 2-4 unit roundoffs
        pre, _, got = _run(name, inverse_dtype=dtype, compute_method=method)
        assert all(v.dtype == dtype for v in pre.decompositions[""].values())
        err = _relative_error(got, want)
        assert base < err < 8 * UNIT[dtype], (dtype, err)

        # factor_dtype: the preconditioner solves with the rounded factors A' = A + E_A, G' = G + E_G, i.e. with
        # the operator M' instead of M (see _operator), and |M'^-1 v - M^-1 v| / |M^-1 v| <= k / (1 - k) for
        # k = |M^-1| |M' - M| < 1 (the perturbation bound of a linear solve), plus the float32 arithmetic (base).
        # M' - M is E_A (x) G + A (x) E_G + E_A (x) E_G (eigen; A, G shifted by gamma for inverse), whose norm
        # is at most the sum of the products of the norms. For k >= 1 no bound follows: the rounding of the
        # factors reaches their smallest eigenvalues plus the damping, and the error is of order 1.
        pre, _, got = _run(name, factor_dtype=dtype, compute_method=method)
        assert pre.factors[""]["A"].dtype == dtype
        e_a, e_g = pre.factors[""]["A"].double() - a, pre.factors[""]["G"].double() - g
        la, lg = (float(torch.linalg.eigvalsh(m)[0].clamp_min(0)) for m in (a, g))
        shift = DAMPING if method == "inverse" else 0.0
        na, ng = _norm2(a) + shift, _norm2(g) + shift
        m_inv = 1.0 / ((la + shift) * (lg + shift) + (0.0 if shift else DAMPING))
        k = m_inv * (_norm2(e_a) * ng + na * _norm2(e_g) + _norm2(e_a) * _norm2(e_g))
        err = _relative_error(got, want)
        assert err > base
        if k < 1:
            assert err <= k / (1 - k) + 10 * base, (dtype, err, k)
        else:
            assert err < 1.0, (dtype, err, k)
        if dtype == torch.float16 and name == "conv":
            assert k < 1  # the bound is exercised


def test_default_is_unchanged():
    """No storage option and the explicit defaults give the same bits."""
    a = _run("conv")
    b = _run("conv", factor_dtype="float32", inverse_dtype="float32")
    assert torch.equal(a[2], b[2]) and a[0].factors[""]["A"].dtype == torch.float32

"""Decompositions of the Kronecker factors and the two preconditioning rules of the paper.

* eigen (default): ``A = Q_A diag(v_A) Q_A^T``, ``G = Q_G diag(v_G) Q_G^T`` and Eq 13-15::

      V1 = Q_G^T grad Q_A;   V2 = V1 / (v_G v_A^T + damping);   P = Q_G V2 Q_A^T

  which is exactly ``(A (x) G + damping I)^-1 vec(grad)``.
* inverse: Eq 11-12, ``P = (G + damping I)^-1 grad (A + damping I)^-1``.

Decompositions run in float32 (or float64 when asked) whatever the training dtype. ``torch.linalg.eigh`` can
fail to converge on ill-conditioned fp32 input; we then retry in float64, then with growing jitter on the
diagonal, and only if all of that fails return None so the caller keeps its previous decomposition: training
never stops because of one bad factor.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["safe_eigh", "safe_damped_inverse", "precondition_eigen", "precondition_inverse", "JITTERS"]

#: relative diagonal jitter tried after the float64 retry (times mean |diag|)
JITTERS = (1e-6, 1e-4, 1e-2)


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _jitter_scale(x: torch.Tensor) -> float:
    return float(x.diagonal().abs().mean().clamp_min(1e-12))


def safe_eigh(factor: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(eigenvalues, eigenvectors)`` of a symmetric PSD factor in ``dtype``; negative round-off eigenvalues are
    clamped to 0 (the factor is PSD by construction). Falls back to float64, then jitter; None if all fail."""
    x = factor.to(dtype)
    x = 0.5 * (x + x.t())  # allreduce/running averages can break exact symmetry by round-off
    attempts: list[tuple[torch.dtype, float]] = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts += [(torch.float64, j) for j in JITTERS]
    for i, (dt, jitter) in enumerate(attempts):
        y = x.to(dt)
        if jitter:
            y = y + jitter * _jitter_scale(y) * torch.eye(y.shape[0], dtype=dt, device=y.device)
        try:
            d, q = torch.linalg.eigh(y)
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            continue
        if not _finite(d, q):
            continue
        if i > 0:
            warnings.warn(f"K-FAC: eigh of factor {name!r} needed the fallback ({dt}, jitter {jitter:g})", RuntimeWarning, stacklevel=2)
        return d.clamp_min(0).to(dtype), q.to(dtype)
    warnings.warn(f"K-FAC: eigh of factor {name!r} failed even with jitter; keeping its previous decomposition", RuntimeWarning, stacklevel=2)
    return None


def safe_damped_inverse(factor: torch.Tensor, damping: float, dtype: torch.dtype = torch.float32, name: str = "") -> torch.Tensor | None:
    """``(factor + damping I)^-1`` in ``dtype`` with the same float64 / jitter fallbacks as :func:`safe_eigh`."""
    x = factor.to(dtype)
    x = 0.5 * (x + x.t())
    attempts: list[tuple[torch.dtype, float]] = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts += [(torch.float64, j) for j in JITTERS]
    for i, (dt, jitter) in enumerate(attempts):
        y = x.to(dt)
        eye = torch.eye(y.shape[0], dtype=dt, device=y.device)
        y = y + (damping + jitter * _jitter_scale(y)) * eye
        try:
            inv = torch.linalg.inv(y)
        except RuntimeError:
            continue
        if not _finite(inv):
            continue
        if i > 0:
            warnings.warn(f"K-FAC: inverse of factor {name!r} needed the fallback ({dt}, jitter {jitter:g})", RuntimeWarning, stacklevel=2)
        return inv.to(dtype)
    warnings.warn(f"K-FAC: inverse of factor {name!r} failed even with jitter; keeping the previous one", RuntimeWarning, stacklevel=2)
    return None


def precondition_eigen(grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
    """Eq 13-15 on a ``(g_dim, a_dim)`` gradient matrix; computed in the decomposition dtype."""
    g = grad.to(qa.dtype)
    v1 = qg.t() @ g @ qa
    v2 = v1 / (dg.unsqueeze(1) * da.unsqueeze(0) + damping)
    return qg @ v2 @ qa.t()


def precondition_inverse(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """Eq 12: ``(G + damping I)^-1 grad (A + damping I)^-1`` with the damped inverses precomputed."""
    return g_inv @ grad.to(a_inv.dtype) @ a_inv

"""Decompositions of the Kronecker factors and the two preconditioning rules of the paper.

* eigen (default): ``A = Q_A diag(v_A) Q_A^T``, ``G = Q_G diag(v_G) Q_G^T`` and Eq 13-15::

      V1 = Q_G^T grad Q_A;   V2 = V1 / (v_G v_A^T + damping);   P = Q_G V2 Q_A^T

  which is exactly ``(A (x) G + damping I)^-1 vec(grad)``.
* inverse: Eq 11-12, ``P = (G + damping I)^-1 grad (A + damping I)^-1``.

Decompositions run in float32 (or float64 when asked) whatever the training dtype. ``torch.linalg.eigh`` can
fail to converge on ill-conditioned fp32 input; we then retry in float64, then with growing jitter on the
diagonal, and only if all of that fails return None so the caller keeps its previous decomposition: training
never stops because of one bad factor.

The Kronecker factors themselves are Gram matrices ``sum a a^T`` over many rows (``N T`` rows of ``C kh kw``
columns for a convolution's A, about 9x the layer's forward FLOPs): :func:`sym_gram` computes them with half the
FLOPs (BLAS ``syrk``, upper triangle only) from cache-sized chunks, which is what keeps K-FAC's factor steps cheap.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch

try:  # optional: BLAS syrk on CPU (scipy comes with the `digits` extra through scikit-learn)
    from scipy.linalg import blas as _scipy_blas
except ImportError:  # pragma: no cover - depends on the environment
    _scipy_blas = None

__all__ = ["JITTERS", "precondition_eigen", "precondition_inverse", "safe_damped_inverse", "safe_eigh", "sym_gram"]

#: elements of the chunk buffer :func:`sym_gram` copies rows into (2 MiB in float32: it stays in the L2/L3 cache)
GRAM_CHUNK_ELEMENTS = 1 << 19
#: smallest side for which the BLAS syrk path pays off: below it (and when the rows fit one chunk), one matrix
#: product from a single copy is cheaper than syrk's call overhead plus the mirroring (measured on the digits CNN:
#: 32x32 and 64x64 G factors, 9x9 and 65x65 A factors; 288x288 A factors keep syrk, 0.70x the time of a product)
SYRK_MIN_DIM = 128

@functools.cache
def _single_thread_blas() -> None:
    """Keep scipy's BLAS (OpenBLAS in scipy's wheels) at one thread; done once per process.

    OpenBLAS runs its own thread pool beside torch's OpenMP pool, and both spin-wait between calls: with more
    than one torch thread, the two pools oversubscribe the cores and every op slows down (measured on the digits
    CNN, 2 threads on 2 cores: K-FAC factor steps 115 ms instead of 12 ms, 30x SGD). So syrk is only used when
    torch itself runs on one thread (:func:`_syrk_applies`), and then with one BLAS thread. A no-op without
    threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController

        libs = [lib for lib in ThreadpoolController().lib_controllers if lib.filepath and "scipy" in lib.filepath and lib.user_api == "blas"]
    except Exception:  # threadpoolctl missing or unable to inspect the process: leave BLAS as it is
        return
    for lib in libs:
        lib.set_num_threads(1)


def _syrk_applies(t: torch.Tensor) -> bool:
    """scipy's BLAS ``syrk`` for this Gram: CPU float32/float64 with scipy installed, and torch on one thread
    (with several, torch's own multi-threaded product is faster and does not fight a second pool; see
    :func:`_single_thread_blas`)."""
    return (t.device.type == "cpu" and _scipy_blas is not None and t.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() == 1)  # fmt: skip


def sym_gram(t: torch.Tensor, k_dims: int = 1, colsum: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_n sum_p a_{n,p} a_{n,p}^T`` for ``t`` of shape ``(N, *K, *P)`` (any strides): ``a`` runs over the
    ``prod(K)``-vectors at each sample ``n`` and position ``p``. Also returns ``sum a`` when ``colsum`` (the bias
    row/column of A, folded in analytically instead of appending a column of ones to a copy of the rows).

    Chunks of samples are copied into one cache-sized ``(K, chunk * P)`` buffer (the only copy; ``t`` may be a
    strided window view of a convolution input) and accumulated. On CPU with scipy and one torch thread, BLAS
    ``ssyrk``/``dsyrk`` computes only the upper triangle (half the FLOPs of a matrix product); elsewhere (CUDA,
    no scipy, several torch threads) a plain ``addmm``. Rows that fit one chunk with ``k < SYRK_MIN_DIM`` take one copy and one matrix product instead
    (syrk's call and mirroring cost more than the FLOPs it saves there). All are the exact sums, up to the
    summation order of floating point.
    """
    n = t.shape[0]
    kshape, pshape = tuple(t.shape[1 : 1 + k_dims]), tuple(t.shape[1 + k_dims :])
    k, p = math.prod(kshape), math.prod(pshape)
    use_syrk = _syrk_applies(t)
    if n * k * p <= GRAM_CHUNK_ELEMENTS and not (use_syrk and k >= SYRK_MIN_DIM):
        # Small: one copy (none when t is already a plain row matrix) and one product; exact sums as well.
        rows = t.movedim(0, k_dims).reshape(k, n * p)
        return rows @ rows.t(), (rows.sum(dim=1) if colsum else None)
    syrk = None
    if use_syrk:
        syrk = _scipy_blas.ssyrk if t.dtype == torch.float32 else _scipy_blas.dsyrk
        _single_thread_blas()
    per_chunk = max(1, min(n, GRAM_CHUNK_ELEMENTS // max(1, k * p)))
    buf = t.new_empty(k * per_chunk * p)
    # Fortran-ordered (k, k) result for syrk: its upper triangle is filled in place (overwrite_c, beta=1).
    acc = torch.zeros(k, k, dtype=t.dtype, device=t.device)
    acc_f = acc.t()  # a Fortran-contiguous view of the same memory, as numpy sees it
    sums = torch.zeros(k, dtype=t.dtype, device=t.device) if colsum else None
    for start in range(0, n, per_chunk):
        m = min(per_chunk, n - start)
        chunk = buf[: k * m * p].view(*kshape, m, *pshape)
        chunk.copy_(t[start : start + m].movedim(0, k_dims))
        rows = chunk.view(k, m * p)
        if syrk is not None:
            # rows (k, m p) C-contiguous is the Fortran (m p, k) matrix X: syrk(trans=1) gives X^T X = rows rows^T
            syrk(1.0, rows.numpy().T, beta=1.0, c=acc_f.numpy(), trans=1, lower=0, overwrite_c=1)
        else:
            acc.addmm_(rows, rows.t())
        if sums is not None:
            sums += rows.sum(dim=1)
    if syrk is not None:
        # acc_f's upper triangle (Fortran) is acc's lower triangle (C order); acc's upper triangle is still 0:
        # adding the transposed strict lower triangle mirrors it (one tril, one add).
        acc += acc.tril(-1).t()
    return acc, sums

#: relative diagonal jitter tried after the float64 retry (times mean |diag|)
JITTERS = (1e-6, 1e-4, 1e-2)


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _jitter_scale(x: torch.Tensor) -> float:
    return float(x.diagonal().abs().mean().clamp_min(1e-12))


def _with_fallbacks(factor: torch.Tensor, dtype: torch.dtype, what: str, name: str, kept: str,
                    solve: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...] | None:
    """Run ``solve(symmetric factor, jitter)`` in ``dtype``, then float64, then float64 with growing diagonal
    jitter (:data:`JITTERS`, relative to mean |diag|) until it returns finite tensors; None (with a warning
    naming what is ``kept``) if every attempt fails, so training goes on with the previous result."""
    x = factor.to(dtype)
    x = 0.5 * (x + x.t())  # allreduce/running averages can break exact symmetry by round-off
    attempts: list[tuple[torch.dtype, float]] = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts += [(torch.float64, j) for j in JITTERS]
    for i, (dt, jitter) in enumerate(attempts):
        y = x.to(dt)
        try:
            out = solve(y, jitter * _jitter_scale(y) if jitter else 0.0)
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            continue
        if not _finite(*out):
            continue
        if i > 0:
            warnings.warn(f"K-FAC: {what} of factor {name!r} needed the fallback ({dt}, jitter {jitter:g})", RuntimeWarning, stacklevel=3)
        return out
    warnings.warn(f"K-FAC: {what} of factor {name!r} failed even with jitter; keeping {kept}", RuntimeWarning, stacklevel=3)
    return None


def _eye(y: torch.Tensor) -> torch.Tensor:
    return torch.eye(y.shape[0], dtype=y.dtype, device=y.device)


def safe_eigh(factor: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(eigenvalues, eigenvectors)`` of a symmetric PSD factor in ``dtype``; negative round-off eigenvalues are
    clamped to 0 (the factor is PSD by construction). Falls back to float64, then jitter; None if all fail."""

    def solve(y: torch.Tensor, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.eigh(y + shift * _eye(y) if shift else y)

    res = _with_fallbacks(factor, dtype, "eigh", name, "its previous decomposition", solve)
    return None if res is None else (res[0].clamp_min(0).to(dtype), res[1].to(dtype))


def safe_damped_inverse(factor: torch.Tensor, damping: float, dtype: torch.dtype = torch.float32, name: str = "") -> torch.Tensor | None:
    """``(factor + damping I)^-1`` in ``dtype`` with the same float64 / jitter fallbacks as :func:`safe_eigh`."""

    def solve(y: torch.Tensor, shift: float) -> tuple[torch.Tensor]:
        return (torch.linalg.inv(y + (damping + shift) * _eye(y)),)

    res = _with_fallbacks(factor, dtype, "inverse", name, "the previous one", solve)
    return None if res is None else res[0].to(dtype)


def precondition_eigen(grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
    """Eq 13-15 on a ``(g_dim, a_dim)`` gradient matrix; computed in the decomposition dtype."""
    g = grad.to(qa.dtype)
    v1 = qg.t() @ g @ qa
    v2 = v1 / (dg.unsqueeze(1) * da.unsqueeze(0) + damping)
    return qg @ v2 @ qa.t()


def precondition_inverse(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """Eq 12: ``(G + damping I)^-1 grad (A + damping I)^-1`` with the damped inverses precomputed."""
    return g_inv @ grad.to(a_inv.dtype) @ a_inv

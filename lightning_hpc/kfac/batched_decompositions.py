"""Batched decompositions: step 2 of Algorithm 1 (the eigendecompositions of Eq 13-14, or the damped inverses of
Eq 11) for all factors of one side length in one batched ``torch.linalg.eigh`` / ``torch.linalg.inv``, instead of
one call per factor.

A factor's own decomposition costs a fixed sequence of kernels (the cast, the symmetrisation, the solver, the
finiteness check, the layout copy) and a host synchronisation (the check's read-back), whatever its size: on a
GPU, for the many small factors of a modern CNN, that sequence, not the arithmetic, is the decomposition step's
cost. Here the dense factors (:class:`~.forms.DenseForm`, one ``n x n`` matrix) and the block-diagonal ones
(:class:`~.forms.BlockDiagonalForm`, ``c`` blocks of ``k x k``) that share a side length, a dtype and a device are
concatenated into one ``(B, n, n)`` batch, symmetrised and decomposed together, checked for finiteness with one
read-back, and handed back as views of the batch's results. The per-factor route runs exactly the same
element-wise operations and the same solver per matrix, so each result is the per-factor one (bitwise on a CPU
for ``eigh``; ``inv`` within rounding where a multi-threaded LAPACK splits a single matrix differently from a
batch).

Failures stay per factor: when the batched solver raises (``torch.linalg.eigh`` raises for the whole batch when
one matrix does not converge) every member of the batch, and when some results are not finite the members those
rows belong to, are decomposed again one by one by :meth:`~.layers.state.FactorState.decompose`, with its float64
and jitter fallbacks and its previous-decomposition rule (:mod:`~lightning_hpc.kfac.linalg`): one bad factor
never changes another's decomposition. Other forms (an embedding's diagonal A, decomposed element-wise) take the
per-factor route; a factor without a partner of its side length is a batch of one (the same operations, with the
batch's one read-back instead of one per result). A batch holds at most :data:`BATCH_ELEMENTS` elements, so the
temporaries of the largest factors (ResNet-50's 4,608-square A) stay bounded; larger groups are split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_hpc.kfac.forms import BlockDiagonalForm, DenseForm, FactorForm
from lightning_hpc.kfac.layers.state import FactorState
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["BATCH_ELEMENTS", "decompose_factors"]

#: most elements of one batch of factors decomposed together (256 MiB in float32): the batch's copy and its
#: symmetrised temporaries are that size; a group of larger total is split into batches of this size
BATCH_ELEMENTS = 1 << 26

Item = tuple[FactorState, str]
Results = dict[tuple[str, str], dict[str, torch.Tensor]]


def _matrices(form: FactorForm) -> tuple[int, int] | None:
    """``(matrices, side)`` of a factor decomposed as a stack of square matrices; None for other forms."""
    if isinstance(form, DenseForm):
        return 1, form.n
    if isinstance(form, BlockDiagonalForm):
        return form.blocks, form.k
    return None


def decompose_factors(items: Sequence[Item], method: ComputeMethod, damping: float, dtype: torch.dtype,
                      storage: torch.dtype) -> Results:
    """The decomposition of each ``(state, factor name)`` of ``items`` as :meth:`FactorState.decompose` gives it
    (computed in ``dtype``, stored in ``storage``; the previous one or an identity's where every fallback fails),
    by ``(layer name, factor name)`` in the order of ``items``, factors of one side length decomposed together
    (see the module docstring)."""
    results: Results = {}
    groups: dict[tuple[int, torch.dtype, torch.device], list[tuple[FactorState, str, int]]] = {}
    for state, kind in items:
        shape = _matrices(state.forms[kind])
        factor = state.factors[kind]
        if shape is None:
            results[(state.name, kind)] = state.decompose(kind, method, damping, dtype, storage)
        else:
            groups.setdefault((shape[1], factor.dtype, factor.device), []).append((state, kind, shape[0]))
    for (n, _, _), members in groups.items():
        for batch in _batches(members, n):
            results.update(_decompose_batch(batch, n, method, damping, dtype, storage))
    return {(state.name, kind): results[(state.name, kind)] for state, kind in items}


def _batches(members: list[tuple[FactorState, str, int]], n: int) -> list[list[tuple[FactorState, str, int]]]:
    """``members`` in order, cut into batches of at most :data:`BATCH_ELEMENTS` elements (a larger factor alone)."""
    out: list[list[tuple[FactorState, str, int]]] = [[]]
    size = 0
    for m in members:
        elements = m[2] * n * n
        if out[-1] and size + elements > BATCH_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(m)
        size += elements
    return out


def _solve(x: torch.Tensor, method: ComputeMethod, damping: float) -> dict[str, torch.Tensor]:
    """The first attempt of :func:`~.linalg.safe_eigh` / :func:`~.linalg.safe_damped_inverse` on a symmetrised
    batch: the same operations, so each matrix's result is the per-factor one."""
    if method.name == "eigen":
        vals, vecs = torch.linalg.eigh(x)
        return {"d": vals, "q": vecs}
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    return {"inv": torch.linalg.inv(x + damping * eye)}


def _decompose_batch(batch: list[tuple[FactorState, str, int]], n: int, method: ComputeMethod, damping: float,
                     dtype: torch.dtype, storage: torch.dtype) -> Results:
    x = torch.cat([state.factors[kind].reshape(-1, n, n) for state, kind, _ in batch]).to(dtype)
    x = 0.5 * (x + x.mT)  # as the per-factor route: averaging and all-reduces can break exact symmetry
    try:
        res = _solve(x, method, damping)
    except RuntimeError:  # one matrix failed (torch.linalg.LinAlgError): every factor on its own
        res = None
    bad: set[int] = set()
    if res is not None:
        # row-major, as the methods' decompose (LAPACK returns column-major matrices)
        res = {k: v.contiguous() for k, v in res.items()}
        # A NaN or an infinity in a matrix's results makes its row sum non-finite, and the batch's sum: one
        # reduction per result and one read-back for the batch; which rows failed is read only when one did. (A
        # sum that overflows while every entry is finite only sends its factors down the per-factor route.)
        sums = [t.flatten(1).sum(dim=1) for t in res.values()]
        row_sums = sums[0] if len(sums) == 1 else sums[0] + sums[1]
        if not math.isfinite(row_sums.sum().item()):
            bad = set(torch.nonzero(~torch.isfinite(row_sums)).flatten().tolist())
        if method.name == "eigen":  # as safe_eigh: negative round-off eigenvalues clamped
            res["d"] = res["d"].clamp_min(0)
        res = {k: v.to(storage) for k, v in res.items()}
    out: Results = {}
    start = 0
    for state, kind, matrices in batch:
        stop = start + matrices
        if res is None or any(start <= r < stop for r in bad):
            out[(state.name, kind)] = state.decompose(kind, method, damping, dtype, storage)
        else:
            shapes = state.result_shapes(kind, method)
            out[(state.name, kind)] = {k: res[k][start:stop].view(shapes[k]) for k in shapes}
        start = stop
    return out

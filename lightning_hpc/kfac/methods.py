"""How a layer's factors are decomposed and its gradient preconditioned: one class per ``compute_method``.

* :class:`EigenMethod` (``"eigen"``, default): ``A = Q_A diag(v_A) Q_A^T``, ``G = Q_G diag(v_G) Q_G^T``
  (SC20 Eq 13-14), and Eq 15 ``P = Q_G [(Q_G^T grad Q_A) / (v_G v_A^T + gamma)] Q_A^T``, which is exactly
  ``(A (x) G + gamma I)^-1 vec(grad)``. The damping is applied at preconditioning time.
* :class:`InverseMethod` (``"inverse"``): Eq 11-12, ``P = (G + gamma I)^-1 grad (A + gamma I)^-1``, with the
  damped inverses computed at decomposition time (a damping change takes effect at the next decomposition).

A decomposition is a dict of tensors named by :meth:`ComputeMethod.result_shapes` (``d``/``q`` or ``inv``); a
layer's handler stores its own as ``{f"{key}_{factor}": tensor}`` (:attr:`~.layers.LayerHandler.decompositions`) and
the preconditioner moves them between ranks as flat buffers. Factors of other forms than a dense matrix (an
embedding's diagonal A, a normalisation layer's per-channel blocks) are decomposed by their form
(:mod:`.forms`) under the same names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lightning_hpc.kfac.linalg import (
    eigen_scale,
    keeps_transposes,
    precondition_eigen,
    precondition_inverse,
    safe_damped_inverse,
    safe_eigh,
)

__all__ = ["COMPUTE_METHODS", "ComputeMethod", "EigenMethod", "InverseMethod", "make_method"]


class ComputeMethod(ABC):
    """Decomposition of one factor and preconditioning of one layer's gradient matrix."""

    name: str

    @abstractmethod
    def result_shapes(self, n: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the tensors that make up the decomposition of an ``n x n`` factor."""

    @abstractmethod
    def decompose(
        self, factor: torch.Tensor, damping: float, dtype: torch.dtype, name: str
    ) -> dict[str, torch.Tensor] | None:
        """The decomposition in ``dtype`` (row-major tensors), or None if every fallback failed."""

    @abstractmethod
    def identity(self, n: int, damping: float, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The decomposition of an identity factor: used when none ever succeeded (a damped SGD step)."""

    @abstractmethod
    def precondition(self, grad: torch.Tensor, d: dict[str, torch.Tensor], damping: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Precondition a ``(g_dim, a_dim)`` gradient with the layer's decompositions ``d`` (keys ``k_A``/``k_G``).
        ``out``, a tensor of the result's shape and dtype, may receive the result (the returned tensor is then
        ``out``), saving a copy (:mod:`lightning_hpc.kfac.batched`'s output buffers)."""

    def padded(self, d: dict[str, torch.Tensor], sizes: dict[str, int], damping: float) -> dict[str, torch.Tensor]:
        """The decompositions ``d`` (keys ``k_A``/``k_G``) of the factors padded to ``sizes["A"]`` and
        ``sizes["G"]`` with an identity block: ``blockdiag(A, I)`` decomposes into ``A``'s decomposition beside the
        identity's (:meth:`identity`), so a gradient padded with zeros is preconditioned to the layer's own result
        beside zeros (a bucket of layers of different shapes, :mod:`lightning_hpc.kfac.batched`)."""
        out: dict[str, torch.Tensor] = {}
        fills: dict[str, dict[str, torch.Tensor]] = {}  # one identity per side, shared by its parts (d and q)
        for key, t in d.items():
            part, side = key.rsplit("_", 1)
            extra = sizes[side] - t.shape[-1]
            if extra == 0:
                out[key] = t
                continue
            if side not in fills:
                fills[side] = self.identity(extra, damping, t.dtype, t.device)
            fill = fills[side][part]
            out[key] = torch.cat([t, fill]) if t.dim() == 1 else torch.block_diag(t, fill)
        return out

    def product_operands(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``d`` with what :meth:`precondition` reads besides the decompositions, derived from them once and kept
        with them (:mod:`lightning_hpc.kfac.batched` keeps them with its stacks): nothing by default."""
        return d

    def damped_operands(self, d: dict[str, torch.Tensor], damping: float) -> dict[str, torch.Tensor]:
        """``d`` (already :meth:`product_operands`) with what :meth:`precondition` reads that depends on the
        damping, derived once per decomposition and damping and kept with them (:mod:`lightning_hpc.kfac.batched`
        keeps them with its stacks): nothing by default."""
        return d

    @abstractmethod
    def kronecker_flops(self, g_dim: int, a_dim: int) -> int:
        """Floating-point operations of the matrix products of :meth:`precondition` on one ``(g_dim, a_dim)`` block
        (a multiply-add counts 2, as ``torch.utils.flop_counter`` counts them); the element-wise part, ``O(g_dim
        a_dim)``, is left out. The every-step cost of the route, whatever the kernels achieve."""


class EigenMethod(ComputeMethod):
    """Eq 13-15 (eigendecompositions; damping added to the eigenvalue products)."""

    name = "eigen"

    def result_shapes(self, n: int) -> dict[str, tuple[int, ...]]:
        return {"d": (n,), "q": (n, n)}

    def decompose(
        self, factor: torch.Tensor, damping: float, dtype: torch.dtype, name: str
    ) -> dict[str, torch.Tensor] | None:
        # Row-major copies: LAPACK returns column-major matrices, and the broadcast or a checkpoint hands other
        # ranks / resumed runs row-major ones; the products of Eq 13-15 must see one layout to round alike.
        res = safe_eigh(factor, dtype, name)
        return None if res is None else {"d": res[0].contiguous(), "q": res[1].contiguous()}

    def identity(self, n: int, damping: float, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        return {"d": torch.ones(n, dtype=dtype, device=device), "q": torch.eye(n, dtype=dtype, device=device)}

    def precondition(self, grad: torch.Tensor, d: dict[str, torch.Tensor], damping: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        return precondition_eigen(grad, d["q_A"], d["d_A"], d["q_G"], d["d_G"], damping, d.get("qT_A"),
                                  d.get("qT_G"), d.get("scale"), out)

    def product_operands(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``d`` with row-major copies of ``Q_A^T`` and ``Q_G^T`` (``qT_A``, ``qT_G``) where Eq 15's products run
        through oneDNN (:func:`~lightning_hpc.kfac.linalg.keeps_transposes`), which would otherwise transpose them at
        every step."""
        extra = {f"qT_{side}": d[f"q_{side}"].mT.contiguous() for side in ("A", "G")
                 if f"q_{side}" in d and keeps_transposes(d[f"q_{side}"])}  # fmt: skip
        return {**d, **extra} if extra else d

    def damped_operands(self, d: dict[str, torch.Tensor], damping: float) -> dict[str, torch.Tensor]:
        """``d`` with Eq 14's ``1 / (v_G v_A^T + damping)`` (``scale``, :func:`~lightning_hpc.kfac.linalg.
        eigen_scale`): one gradient's size in memory, and one multiplication per step instead of three passes."""
        return {**d, "scale": eigen_scale(d["d_A"], d["d_G"], damping)}

    def kronecker_flops(self, g_dim: int, a_dim: int) -> int:
        # four products: Q_G^T grad and Q_G V2 (g^2 a each), then Q_A and Q_A^T (g a^2 each)
        return 4 * g_dim * a_dim * (g_dim + a_dim)


class InverseMethod(ComputeMethod):
    """Eq 11-12 (damped inverses of each factor)."""

    name = "inverse"

    def result_shapes(self, n: int) -> dict[str, tuple[int, ...]]:
        return {"inv": (n, n)}

    def decompose(
        self, factor: torch.Tensor, damping: float, dtype: torch.dtype, name: str
    ) -> dict[str, torch.Tensor] | None:
        inv = safe_damped_inverse(factor, damping, dtype, name)
        return None if inv is None else {"inv": inv.contiguous()}

    def identity(self, n: int, damping: float, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        return {"inv": torch.eye(n, dtype=dtype, device=device) / (1.0 + damping)}

    def precondition(self, grad: torch.Tensor, d: dict[str, torch.Tensor], damping: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        return precondition_inverse(grad, d["inv_A"], d["inv_G"])

    def kronecker_flops(self, g_dim: int, a_dim: int) -> int:
        # two products: (G + damping I)^-1 grad (g^2 a), then (A + damping I)^-1 (g a^2)
        return 2 * g_dim * a_dim * (g_dim + a_dim)


#: ``compute_method`` name -> class
COMPUTE_METHODS: dict[str, type[ComputeMethod]] = {"eigen": EigenMethod, "inverse": InverseMethod}


def make_method(name: str) -> ComputeMethod:
    if name not in COMPUTE_METHODS:
        raise ValueError(f"K-FAC compute_method must be one of {tuple(COMPUTE_METHODS)}, got {name!r}")
    return COMPUTE_METHODS[name]()

"""How one curvature factor is stored, averaged over ranks, decomposed and priced: one :class:`FactorForm` per
factor of a layer.

A layer's handler (:mod:`.layers`) says which factors it keeps and of which form
(:meth:`~lightning_hpc.kfac.layers.LayerHandler.factor_forms`); everything that moves or decomposes a factor asks
its form, so the preconditioner, the overlapped all-reduce, the placement and ``plan-kfac`` need not know the
layer type:

* :class:`DenseForm` -- a symmetric ``n x n`` matrix: A and G of Linear and convolution layers (KFC), G of an
  embedding. Decomposed by the ``compute_method`` (eigenpairs or the damped inverse); all-reduced as its upper
  triangle; costs ``n^3`` to decompose.
* :class:`DiagonalForm` -- a diagonal ``n x n`` matrix kept as its ``n`` diagonal entries: the input factor of an
  ``nn.Embedding`` (its inputs are one-hot rows, so ``E[a a^T]`` is the diagonal of token frequencies; ASDL's
  ``Embedding`` factor, Osawa et al.). Its eigenbasis is the identity: the eigen method keeps the entries, the
  inverse method ``1 / (d + damping)``.
* :class:`BlockDiagonalForm` -- ``c`` independent symmetric ``k x k`` blocks, ``(c, k, k)``: the per-channel
  ``(scale, shift)`` Fisher blocks of a normalisation layer's affine parameters (KFAC-JAX's scale-and-shift
  blocks), and the per-group KFC factors of a grouped or depthwise convolution. All blocks are decomposed by one
  batched ``eigh`` / inverse; all-reduced as the blocks' upper triangles.

A decomposition is a dict of tensors named by :meth:`FactorForm.result_shapes`, the same names as the method's
for a dense factor (``d``/``q`` or ``inv``), so checkpoints and broadcasts treat every form alike.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_hpc.kfac.linalg import safe_damped_inverse, safe_eigh
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["BlockDiagonalForm", "DenseForm", "DiagonalForm", "FactorForm", "LayerDims", "LayerForms", "layer_forms"]


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    iu = torch.triu_indices(n, n, device=device)
    return iu[0], iu[1]


class FactorForm(ABC):
    """The storage layout and the verbs of one running factor (see the module docstring)."""

    #: shape of the stored factor
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    @abstractmethod
    def cost(self) -> int:
        """Decomposition cost (multiply-adds up to a constant): the weight the ``balanced`` placement spreads."""

    @abstractmethod
    def packed_numel(self, symmetric: bool) -> int:
        """Elements of the factor in the all-reduce (``symmetric``: upper triangles of symmetric matrices)."""

    @abstractmethod
    def pack(self, t: torch.Tensor, symmetric: bool) -> torch.Tensor:
        """The factor as the flat vector the all-reduce sends."""

    @abstractmethod
    def unpack(self, v: torch.Tensor, symmetric: bool) -> torch.Tensor:
        """The factor from :meth:`pack`'s vector (a fresh tensor)."""

    @abstractmethod
    def result_shapes(self, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the tensors of the factor's decomposition under ``method``."""

    @abstractmethod
    def decompose(self, factor: torch.Tensor, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  name: str) -> dict[str, torch.Tensor] | None:
        """The decomposition in ``dtype``, or None when every fallback failed (the previous one is kept)."""

    @abstractmethod
    def identity(self, method: ComputeMethod, damping: float, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
        """The decomposition of an identity factor (used when none ever succeeded: a damped SGD step)."""


@dataclass(frozen=True)
class DenseForm(FactorForm):
    """A symmetric ``n x n`` factor, decomposed by the compute method (Eq 13-14 or Eq 11)."""

    n: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (self.n, self.n)

    @property
    def cost(self) -> int:
        return self.n**3

    def packed_numel(self, symmetric: bool) -> int:
        return self.n * (self.n + 1) // 2 if symmetric else self.n * self.n

    def pack(self, t: torch.Tensor, symmetric: bool) -> torch.Tensor:
        if not symmetric:
            return t.reshape(-1)
        rows, cols = _triu(self.n, t.device)
        return t[rows, cols]

    def unpack(self, v: torch.Tensor, symmetric: bool) -> torch.Tensor:
        if not symmetric:
            return v.view(self.n, self.n).clone()
        rows, cols = _triu(self.n, v.device)
        m = v.new_empty(self.n, self.n)
        m[rows, cols] = v
        m[cols, rows] = v  # element (i, j) and (j, i) are one sum: the mirror is exact
        return m

    def result_shapes(self, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        return method.result_shapes(self.n)

    def decompose(self, factor: torch.Tensor, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  name: str) -> dict[str, torch.Tensor] | None:
        return method.decompose(factor, damping, dtype, name)

    def identity(self, method: ComputeMethod, damping: float, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
        return method.identity(self.n, damping, dtype, device)


@dataclass(frozen=True)
class DiagonalForm(FactorForm):
    """A diagonal ``n x n`` factor stored as its diagonal ``(n,)``. Its eigenvectors are the unit vectors, so the
    eigen method keeps the entries themselves (``d``) and the inverse method ``1 / (d + damping)`` (``inv``)."""

    n: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (self.n,)

    @property
    def cost(self) -> int:
        return self.n

    def packed_numel(self, symmetric: bool) -> int:
        return self.n

    def pack(self, t: torch.Tensor, symmetric: bool) -> torch.Tensor:
        return t.reshape(-1)

    def unpack(self, v: torch.Tensor, symmetric: bool) -> torch.Tensor:
        return v.clone()

    def result_shapes(self, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        return {"d": (self.n,)} if method.name == "eigen" else {"inv": (self.n,)}

    def decompose(self, factor: torch.Tensor, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  name: str) -> dict[str, torch.Tensor] | None:
        return self._of(factor.to(dtype).clamp_min(0), method, damping)  # a mean of squares: clamps round-off only

    def identity(self, method: ComputeMethod, damping: float, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
        return self._of(torch.ones(self.n, dtype=dtype, device=device), method, damping)

    @staticmethod
    def _of(d: torch.Tensor, method: ComputeMethod, damping: float) -> dict[str, torch.Tensor]:
        return {"d": d} if method.name == "eigen" else {"inv": 1.0 / (d + damping)}


@dataclass(frozen=True)
class BlockDiagonalForm(FactorForm):
    """``blocks`` independent symmetric ``k x k`` blocks stored as ``(blocks, k, k)``, decomposed block by block
    (a batched ``eigh`` / inverse with the float64 and jitter fallbacks of :func:`~.linalg.safe_eigh`)."""

    blocks: int
    k: int

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return (self.blocks, self.k, self.k)

    @property
    def cost(self) -> int:
        return self.blocks * self.k**3

    def packed_numel(self, symmetric: bool) -> int:
        return self.blocks * (self.k * (self.k + 1) // 2 if symmetric else self.k * self.k)

    def pack(self, t: torch.Tensor, symmetric: bool) -> torch.Tensor:
        if not symmetric:
            return t.reshape(-1)
        rows, cols = _triu(self.k, t.device)
        return t[:, rows, cols].reshape(-1)

    def unpack(self, v: torch.Tensor, symmetric: bool) -> torch.Tensor:
        if not symmetric:
            return v.view(self.shape).clone()
        rows, cols = _triu(self.k, v.device)
        tri = v.view(self.blocks, -1)
        m = v.new_empty(self.shape)
        m[:, rows, cols] = tri
        m[:, cols, rows] = tri
        return m

    def result_shapes(self, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        if method.name == "eigen":
            return {"d": (self.blocks, self.k), "q": self.shape}
        return {"inv": self.shape}

    def decompose(self, factor: torch.Tensor, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  name: str) -> dict[str, torch.Tensor] | None:
        if method.name == "eigen":
            res = safe_eigh(factor, dtype, name)
            return None if res is None else {"d": res[0].contiguous(), "q": res[1].contiguous()}
        inv = safe_damped_inverse(factor, damping, dtype, name)
        return None if inv is None else {"inv": inv.contiguous()}

    def identity(self, method: ComputeMethod, damping: float, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
        eye = torch.eye(self.k, dtype=dtype, device=device).expand(self.shape).contiguous()
        if method.name == "eigen":
            return {"d": torch.ones(self.blocks, self.k, dtype=dtype, device=device), "q": eye}
        return {"inv": eye / (1.0 + damping)}


@dataclass(frozen=True)
class LayerForms:
    """A layer's factors by name, in order, and the shape of its gradient matrix (``(groups, g_dim, a_dim)`` for a
    stack of blocks): what the placement and ``plan-kfac`` price. A plain ``(n_A, n_G)`` pair stands for the
    Kronecker layer of two dense factors."""

    factors: Mapping[str, FactorForm]
    grad_shape: tuple[int, ...]


#: what the placement and ``plan-kfac`` take per layer: ``(n_A, n_G)`` of a Kronecker layer, or its forms
LayerDims = tuple[int, int] | LayerForms


def layer_forms(entry: LayerDims) -> LayerForms:
    """``entry`` as :class:`LayerForms` (a ``(n_A, n_G)`` pair: dense A and G, an ``n_G x n_A`` gradient)."""
    if isinstance(entry, LayerForms):
        return entry
    na, ng = entry
    return LayerForms({"A": DenseForm(na), "G": DenseForm(ng)}, (ng, na))

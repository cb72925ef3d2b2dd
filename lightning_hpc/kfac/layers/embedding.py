"""K-FAC for ``nn.Embedding``: a Linear layer fed one-hot rows, so A is diagonal (the token frequencies, a
:class:`~lightning_hpc.kfac.forms.DiagonalForm`, as ASDL's embedding factor, Osawa et al. 2023) and G is the Linear
layer's dense output-gradient factor (Martens & Grosse 2015).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lightning_hpc.kfac.forms import DenseForm, DiagonalForm, FactorForm
from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.linalg import sym_gram
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["EmbeddingHandler", "embedding_refusal"]


def embedding_refusal(module: nn.Module) -> str | None:
    """Why an embedding is left to the optimizer (None: it is not): a sparse or frequency-scaled gradient."""
    if cast(nn.Embedding, module).sparse or cast(nn.Embedding, module).scale_grad_by_freq:
        return "sparse or frequency-scaled gradient (not the Kronecker form of its factors)"
    return None


class EmbeddingHandler(LayerHandler):
    """``nn.Embedding``: a Linear layer fed one-hot rows, so KFC's A is diagonal.

    Looking up token ``v`` is multiplying ``W^T`` by the one-hot vector ``e_v``, so ``A = E[a a^T]`` over the rows
    (every looked-up position) is ``diag(count_v) / rows``, the token frequencies, and G is the Linear layer's
    (``B sum_n sum_t ds ds^T`` over the positions, :mod:`.base` docstring). A is kept as its diagonal
    (:class:`~.forms.DiagonalForm`), as ASDL's embedding factor (Osawa et al., "ASDL: A Unified Interface for
    Gradient Preconditioning in PyTorch", 2023). The gradient matrix is ``dW^T``, ``(embedding_dim,
    num_embeddings)``: with A's eigenbasis the unit vectors, Eq 15 becomes ``Q_G [(Q_G^T grad) / (v_G d_A^T +
    damping)]``, and the inverse method ``(G + damping I)^-1 grad diag(1 / (d_A + damping))``. Tokens not seen in
    a step have a zero gradient column, which stays zero. Inputs of several dimensions count one sample dimension
    (:attr:`batch_dim`, as a Linear's) and positions.
    """

    module: nn.Embedding
    refuses_split_input = True
    sequence_input = True
    batch_dim: int = 0

    @property
    def a_dim(self) -> int:
        return self.module.num_embeddings

    @property
    def g_dim(self) -> int:
        return self.module.embedding_dim

    form_note = "diagonal A (token frequencies)"

    def factor_forms(self) -> dict[str, FactorForm]:
        return {"A": DiagonalForm(self.a_dim), "G": DenseForm(self.g_dim)}

    def sample_count(self, x: torch.Tensor) -> int:
        if x.dim() == 0:
            return 1
        return x.shape[0] if x.dim() == 1 else x.shape[self.batch_dim]

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        counts = torch.bincount(x.detach().reshape(-1), minlength=self.a_dim)
        return counts.to(self.dtype_for(self.weight)), x.numel()

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(g.detach().reshape(-1, g.shape[-1]).to(self.dtype_for(g)))[0]

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        return None if w.grad is None else w.grad.t()

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad.copy_(mat.t())

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        if method.name == "eigen":
            qg, dg, da = decompositions["q_G"], decompositions["d_G"], decompositions["d_A"]
            v = (qg.t() @ grad.to(qg.dtype)) / (dg.unsqueeze(1) * da.unsqueeze(0) + damping)
            return qg @ v
        inv_g, inv_a = decompositions["inv_G"], decompositions["inv_A"]
        return (inv_g @ grad.to(inv_g.dtype)) * inv_a.unsqueeze(0)

    def precondition_flops(self, method: ComputeMethod) -> int:
        # A is diagonal (a scaling, element-wise): only G's side is a product, twice with eigenpairs
        return (4 if method.name == "eigen" else 2) * self.g_dim**2 * self.a_dim

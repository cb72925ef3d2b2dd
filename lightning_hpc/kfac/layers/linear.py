"""K-FAC for fully-connected layers (``nn.Linear``): the Fisher block ``A (x) G``, A the second moment of the
layer's inputs (a trailing 1 for the bias) and G that of the output gradients (Martens & Grosse 2015, section 3).
Leading input dimensions besides the sample one (sequences, tokens) are positions, as a convolution's (KFC's weight
sharing, Grosse & Martens 2016); :func:`linear_batch_dim` says which of them holds the samples.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.linalg import sym_gram

__all__ = ["LinearHandler", "linear_batch_dim"]


class LinearHandler(LayerHandler):
    """``nn.Linear``; inputs with extra leading dimensions count each position as a row (T = numel / B / in).

    Of the leading dimensions of an input ``(..., in_features)``, :attr:`batch_dim` is the sample dimension and
    all others are positions (KFC's weight sharing, as a convolution's positions): A is the mean over all rows,
    G the per-sample sum over positions. ``batch_dim`` is 0 (batch first) unless the layer sits in a module
    with ``batch_first=False`` (torch's ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` /
    ``MultiheadAttention``, or a user module that sets that attribute), then 1: see
    :func:`linear_batch_dim`.
    """

    module: nn.Linear
    sequence_input = True
    batch_dim: int = 0

    def sample_count(self, x: torch.Tensor) -> int:
        if x.dim() <= 1:
            return 1
        if x.dim() == 2:
            return x.shape[0]
        return x.shape[self.batch_dim]

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_bias(x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x)))

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        return g.detach().reshape(-1, g.shape[-1]).to(self.dtype_for(g))

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x))
        gram, colsum = sym_gram(rows, colsum=self.has_bias)
        return self._fold_bias(gram, colsum, rows.shape[0]), rows.shape[0]

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(self.output_rows(g))[0]


def _batch_first(module: nn.Module) -> bool | None:
    """``module.batch_first`` when it declares one (directly or through a ``MultiheadAttention`` child, as
    ``TransformerEncoderLayer`` does), else None."""
    value = getattr(module, "batch_first", None)
    if isinstance(value, bool):
        return value
    for child in module.children():
        if isinstance(child, nn.MultiheadAttention):
            return bool(child.batch_first)
    return None


def linear_batch_dim(name: str, modules: dict[str, nn.Module]) -> int:
    """Sample dimension of the inputs of the Linear called ``name`` (for inputs of 3 or more dimensions): 1 when
    the nearest enclosing module that declares ``batch_first`` declares it False (sequence-first ``(T, N, d)``
    inputs, torch's default for its Transformer layers), else 0."""
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        parent = modules.get(".".join(parts[:depth]))
        if parent is None:
            continue
        bf = _batch_first(parent)
        if bf is not None:
            return 0 if bf else 1
    return 0

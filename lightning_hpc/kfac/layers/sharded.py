"""K-FAC for a fully-connected layer split over ranks (hybrid_fc's head,
:class:`~lightning_hpc.protocols.ShardedFullyConnected`): the whole layer's Linear factors (Martens & Grosse 2015),
the side each rank sees as a block gathered at the step, so every rank preconditions the layer as one process does
and keeps its own block of the result.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, cast

import torch
from torch import nn

from lightning_hpc.distributed.partitioned import local_block
from lightning_hpc.kfac.layers.linear import LinearHandler
from lightning_hpc.kfac.linalg import sym_gram

__all__ = ["ShardedLinearHandler"]


class ShardedLinearHandler(LinearHandler):
    """A fully-connected layer of which this rank holds one block (:class:`~lightning_hpc.protocols.
    ShardedFullyConnected`: hybrid_fc's head), preconditioned as the whole layer, as one process does.

    Each call is one sub-batch of the ranks' samples, the same rows on every rank, so the rows of all calls are the
    step's samples (counted per call, not as positions of one forward pass).  The side of the layer a rank sees
    whole gives its factor's Gram at once (a column block's input, a row block's output gradient); the other side's
    rows are kept per call and all-gathered along the features at the step, so A and G are the whole layer's, from
    every sample, and equal on every rank (the world mean of the factor all-reduce leaves them so).  The output
    gradients carry ``1 / kfac_grad_scale`` times the mean loss's, undone before they enter G.  At the step the
    gradient ``[dW | db]`` is gathered whole, preconditioned (and KL-clipped) as one process does it, and each rank
    keeps its block.  The gathers are collectives at the step, in layer order: the overlapped factor all-reduce,
    which would run them from backward hooks, is refused for such layers (:class:`KFACPreconditioner`)."""

    gathers_statistics = True

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self._token = -1  # the call whose output gradient is being committed

    def reset_statistics(self) -> None:
        super().reset_statistics()
        #: the gradient scale and the positions per sample of each pending call (the layer's ``kfac_grad_scale`` and
        #: ``kfac_positions`` at its forward)
        self._calls: dict[int, tuple[float, int]] = {}

    @property
    def _layout(self) -> str:
        return str(cast(Any, self.module).layout)

    def discard_committed(self) -> None:
        super().discard_committed()
        #: (token, rows) of the side seen as a block: a row layer's inputs, a column layer's output gradients
        self._blocks: list[tuple[int, torch.Tensor]] = []
        #: the samples of the committed calls: rows / positions per sample, summed exactly (see :meth:`batch_factors`)
        self._samples = Fraction(0)

    def backward_gives_gradient(self) -> bool:
        # the strategy assembles the head's gradient from its sub-batches' backward passes itself
        return True

    def stale_before(self, token: int) -> bool:
        # each call is a sub-batch of the step, and the layer's gradient is assembled from all of them: an earlier
        # call's statistics are this step's whatever the gradient holds while the calls' output gradients arrive
        return False

    def gradient_cleared(self) -> bool:
        grad = self.weight.grad
        return grad is None or not bool(local_block(grad).any())

    @property
    def has_statistics(self) -> bool:
        return self.stats.commits > 0

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._layout == "col":  # the whole input: its Gram now
            return super().input_gram(x)
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x))
        return rows, rows.shape[0]  # this rank's input block: gathered at the step

    def capture_input(self, x: torch.Tensor) -> int:
        self.stats.in_forward = False  # every call is a sub-batch of rows of its own, counted as samples
        token = super().capture_input(x)
        m = cast(Any, self.module)
        # a (batch, tokens, features) input runs through the head as rows, which its sub-batches cut without regard
        # to samples: the rows are counted, and the samples are rows / positions (batch_factors)
        self._calls[token] = (float(m.kfac_grad_scale), int(getattr(m, "kfac_positions", 1)))
        return token

    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        key = token if token is not None else self.stats.latest_token()
        scale, positions = self._calls.pop(key, (1.0, 1))
        self._token = key
        committed = super().capture_output_grad(g * scale if scale != 1.0 else g, token)
        if committed:
            self._samples += Fraction(g.reshape(-1, g.shape[-1]).shape[0], positions)
        return committed

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        if self._layout == "col":
            self.stats.add_input(input_stat, rows)
            self._blocks.append((self._token, self.output_rows(g)))
        else:
            self.stats.a_rows += rows
            self.stats.add_output(self.output_statistic(g))
            self._blocks.append((self._token, input_stat))

    def _gather_statistics(self) -> None:
        """The whole layer's Gram of the blocked side, from every rank's block of every call (collective)."""
        if not self._blocks:
            return
        m = cast(Any, self.module)
        rows = torch.cat([r for _, r in sorted(self._blocks, key=lambda item: item[0])])
        self._blocks = []
        if self._layout == "col":
            self.stats.g_sum = sym_gram(m.kfac_gather(rows, "out", 1))[0]
        else:
            whole = m.kfac_gather(rows, "in", 1)
            gram, colsum = sym_gram(whole, colsum=self.has_bias)
            self.stats.a_sum = self._fold_bias(gram, colsum, whole.shape[0])

    def batch_factors(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`LinearHandler.batch_factors`, with the samples of inputs that have ``T`` positions per sample
        (KFC's weight sharing, as :class:`LinearHandler` counts them): A is the mean over all rows and G the sum of
        the rows' Grams per sample either way, so only the sample count changes, from the rows counted per call
        to rows / T (whichever sub-batch, or rank, each of a sample's positions landed in; micro-batches of other
        lengths each with their own T)."""
        self._gather_statistics()
        a, g = super().batch_factors(grad_scale, batch_averaged)
        rows = max(self.stats.samples, 1)  # what the base class scaled by
        if self._samples and self._samples != rows:
            ratio = float(self._samples / rows)
            g = g * ratio if batch_averaged else g / ratio
        return a, g

    def grad_matrix(self) -> torch.Tensor | None:
        """The whole layer's ``[dW | db]`` (collective: every rank's blocks gathered)."""
        w = self.weight
        if w.grad is None:
            return None
        m = cast(Any, self.module)
        wg = local_block(w.grad)
        bg = None
        if self.has_bias:
            bg = local_block(self.bias.grad) if self.bias.grad is not None else torch.zeros_like(local_block(self.bias))
        if self._layout == "col":
            mat = wg if bg is None else torch.cat([wg, bg.reshape(-1, 1)], dim=1)
            return m.kfac_gather(mat, "out", 0)
        mat = m.kfac_gather(wg, "in", 1)
        if bg is not None:
            mat = torch.cat([mat, m.kfac_gather(bg, "out", 0).reshape(-1, 1)], dim=1)
        return mat

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        """This rank's blocks of the whole layer's preconditioned ``[dW | db]``."""
        w = self.weight
        assert w.grad is not None
        m = cast(Any, self.module)
        n_w = mat.shape[1] - (1 if self.has_bias else 0)
        o0, o1 = m.kfac_block("out")
        if self._layout == "col":
            local_block(w.grad).copy_(mat[o0:o1, :n_w])
        else:
            i0, i1 = m.kfac_block("in")
            local_block(w.grad).copy_(mat[:, i0:i1])
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            local_block(b.grad).copy_(mat[o0:o1, n_w])

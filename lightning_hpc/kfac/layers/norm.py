"""K-FAC for the affine parameters of normalisation layers (BatchNorm, GroupNorm, LayerNorm, RMSNorm, InstanceNorm):
not a Kronecker product but the exact 2x2 Fisher block of each channel's (scale, shift) from the per-sample
gradients, between KFAC-JAX's ``ScaleAndShiftDiagonal`` and ``ScaleAndShiftFull`` curvature blocks (Martens & Grosse
2015, section 3, on layers other than fully connected ones).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac.forms import BlockDiagonalForm, FactorForm
from lightning_hpc.kfac.layers.base import LayerHandler
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["FEATURE_NORMS", "NORMS", "NormAffineHandler", "norm_refusal"]

#: normalisation layers whose affine parameters are preconditioned (``nn.SyncBatchNorm``, which normalises with
#: statistics from other ranks, is none of them; a subclass of one is handled as it is, see
#: :mod:`~lightning_hpc.kfac.subclasses`)
NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)  # fmt: skip
#: the norms over the trailing ``normalized_shape`` of each position (features), not over channels
FEATURE_NORMS = (nn.LayerNorm, nn.RMSNorm)
#: the norms over samples and positions (training-mode batch statistics)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: dimensions of a batched input of each instance norm (one fewer: a single unbatched sample)
_INSTANCE_NORM_DIMS: dict[type[nn.Module], int] = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}


def norm_refusal(module: nn.Module) -> str | None:
    """Why a normalisation layer is left to the optimizer (None: it is not): one without affine parameters."""
    return None if isinstance(getattr(module, "weight", None), torch.Tensor) else "no affine parameters"


class NormAffineHandler(LayerHandler):
    """The affine parameters of a normalisation layer (``nn.BatchNorm1d/2d/3d``, ``nn.GroupNorm``, ``nn.LayerNorm``,
    ``nn.RMSNorm``, ``nn.InstanceNorm1d/2d/3d`` with ``affine=True``): a 2x2 Fisher block per channel over its
    (scale, shift).

    The layer computes ``y = gamma_c xhat + beta_c`` at every position ``t`` of channel ``c`` (``xhat`` the
    normalised input), so the gradient of sample ``n``'s loss is ``d gamma_c = sum_t ds_{n,c,t} xhat_{n,c,t}``,
    ``d beta_c = sum_t ds_{n,c,t}`` (``ds`` as in the :mod:`.base` docstring: ``B * grad_output`` for a mean loss). This
    is not a Kronecker product of an input and an output factor: K-FAC treats such a layer with a block of its own
    from these per-example gradients (Martens & Grosse 2015, section 3, on layers other than fully connected
    ones; KFAC-JAX's ``ScaleAndShiftDiagonal`` / ``ScaleAndShiftFull`` curvature blocks for ``scale_and_shift``
    layers, whose per-example gradients are exactly these). Between KFAC-JAX's diagonal (channels and the two
    parameters independent) and full (all ``2C`` parameters together) blocks this handler keeps, per channel,

        F_c = 1/B sum_n u_{n,c} u_{n,c}^T,    u_{n,c} = (d gamma_c, d beta_c) of sample n,

    the exact Fisher block of the pair (a :class:`~.forms.BlockDiagonalForm` of ``(C, 2, 2)``; ``(C, 1, 1)`` for
    a layer without a trainable shift), and preconditions ``(d gamma_c, d beta_c)`` by ``(F_c + damping I)^-1``.
    The gradient matrix is ``(C, 2)``: columns scale and shift. For a ``LayerNorm`` / ``RMSNorm`` (which has no
    shift: a 1x1 block) the "channels" are the elements of ``normalized_shape`` and the leading dimensions other
    than the sample dimension are positions.

    ``xhat`` is recomputed in the backward hook from the layer's input (kept by reference, which autograd holds
    anyway) with the layer's own normalisation and ``eps``: training-mode batch statistics for BatchNorm (only
    training forwards are captured), per-sample ones for the others. BatchNorm's ``xhat = (x - mu_c) / sigma_c``
    has one scale per channel, so ``d gamma`` is taken as ``(sum_t ds (x - mu_c)) / sigma_c`` from the centred
    input (:meth:`_batch_centered`) without forming ``xhat``: its statistics and the products are row-wise
    reductions, about 40 % less process CPU time than ``F.batch_norm`` and a product of full tensors (the
    BatchNorm layers of ResNet-32 at batch 128, one thread).
    """

    output_gradient_factors = ("F",)
    #: a channel's (scale, shift) block is preconditioned from that channel's rows alone (:meth:`precondition`)
    row_blocks = True
    #: sample dimension of a LayerNorm / RMSNorm input with more than one leading dimension (:func:`linear_batch_dim`)
    batch_dim: int = 0

    @property
    def sequence_input(self) -> bool:  # type: ignore[override]
        return isinstance(self.module, FEATURE_NORMS)

    @property
    def channels(self) -> int:
        m = self.module
        if isinstance(m, FEATURE_NORMS):
            return math.prod(m.normalized_shape)
        return int(m.num_channels if isinstance(m, nn.GroupNorm) else m.num_features)  # type: ignore[arg-type]

    @property
    def a_dim(self) -> int:
        return 1 + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.channels

    def factor_forms(self) -> dict[str, FactorForm]:
        return {"F": BlockDiagonalForm(self.channels, self.a_dim)}

    @property
    def form_note(self) -> str:  # type: ignore[override]
        return "a 2x2 block per channel over scale and shift" if self.has_bias else "a 1x1 block per channel (scale)"

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with a leading sample dimension (an unbatched instance-norm or layer-norm input is one sample)."""
        m = self.module
        if isinstance(m, FEATURE_NORMS):
            extra = t.dim() - len(m.normalized_shape)
            if extra == 0:
                return t.unsqueeze(0)
            return t.movedim(self.batch_dim, 0) if extra >= 2 else t
        batched = next((d for t, d in _INSTANCE_NORM_DIMS.items() if isinstance(m, t)), None)
        return t.unsqueeze(0) if batched is not None and t.dim() == batched - 1 else t

    def sample_count(self, x: torch.Tensor) -> int:
        return self._batched(x).shape[0]

    def captures(self, x: torch.Tensor) -> bool:
        # One tile of a split activation (the spatial strategy's "local" BatchNorm normalises each tile alone):
        # the tile's statistics are not the sample's. Nothing is captured, so the layer is left to the optimizer
        # with the preconditioner's one warning about layers whose hooks do not fire.
        return type(x) is torch.Tensor

    def _by_channel(self, t: torch.Tensor) -> torch.Tensor:
        """``(N, C, positions)`` of a batched tensor of the layer's layout."""
        if isinstance(self.module, FEATURE_NORMS):
            return t.reshape(t.shape[0], -1, self.channels).transpose(1, 2)
        return t.reshape(t.shape[0], t.shape[1], -1)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """``xhat``: the layer's normalisation of ``x`` without its affine parameters."""
        m = self.module
        if isinstance(m, nn.LayerNorm):
            return F.layer_norm(x, m.normalized_shape, eps=m.eps)
        if isinstance(m, nn.RMSNorm):  # scale only: x / rms(x)
            return F.rms_norm(x, m.normalized_shape, eps=m.eps)
        if isinstance(m, nn.GroupNorm):
            return F.group_norm(x, m.num_groups, eps=m.eps)
        assert isinstance(m, tuple(_INSTANCE_NORM_DIMS))  # BatchNorm: _batch_centered
        return F.instance_norm(x, eps=float(cast(Any, m).eps))

    def _batch_centered(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BatchNorm's ``(x - mu_c, 1 / sigma_c)`` of a batched ``(N, C, positions)`` input: training-mode batch
        statistics over samples and positions (biased variance and the layer's ``eps``, as ``F.batch_norm``),
        the variance from the centred input (two passes: no cancellation). ``1 / sigma_c`` is ``(C,)``."""
        count = x.shape[0] * x.shape[2]
        xc = x - (x.sum(dim=-1).sum(dim=0) / count).unsqueeze(-1)
        var = torch.linalg.vecdot(xc, xc).sum(dim=0) / count
        return xc, torch.rsqrt(var + float(cast(Any, self.module).eps))

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        # The statistics need the output gradient as well: keep the input (a reference: no copy) until it comes.
        return x.detach(), 0

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        dtype = self.dtype_for(g)
        gg = self._by_channel(self._batched(g.detach().to(dtype)))
        x = self._batched(input_stat.to(dtype))
        if isinstance(self.module, _BATCH_NORMS):
            xc, inv_sigma = self._batch_centered(self._by_channel(x))
            u = (torch.linalg.vecdot(gg, xc) * inv_sigma).unsqueeze(-1)  # (N, C, 1): per-sample scale gradients
        else:
            u = torch.linalg.vecdot(gg, self._by_channel(self._normalized(x))).unsqueeze(-1)
        if self.has_bias:
            u = torch.cat([u, gg.sum(-1, keepdim=True)], dim=-1)  # and of the shift
        self.stats.add_output(torch.einsum("nci,ncj->cij", u, u))

    @property
    def has_statistics(self) -> bool:
        return self.stats.g_sum is not None

    def batch_statistics(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> dict[str, torch.Tensor]:
        g_sum = self.stats.g_sum
        if g_sum is None:
            raise RuntimeError(f"K-FAC layer {self.name!r}: no statistics captured in this step")
        b = max(self.stats.samples, 1)
        f = g_sum * (b if batch_averaged else 1.0 / b)
        return {"F": f / (grad_scale * grad_scale) if grad_scale != 1.0 else f}

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        if w.grad is None:
            return None
        cols = [w.grad.reshape(-1, 1)]
        if self.has_bias:
            b = self.bias
            cols.append((b.grad if b.grad is not None else torch.zeros_like(b)).reshape(-1, 1))
        return torch.cat(cols, dim=1)

    def grad_views(self, mat: torch.Tensor) -> list[torch.Tensor] | None:
        views = [mat[:, 0].view(self.weight.shape)]
        if self.has_bias:
            views.append(mat[:, 1].view(self.bias.shape))
        return views

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad.copy_(mat[:, 0].reshape_as(w.grad))
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            b.grad.copy_(mat[:, 1].reshape_as(b.grad))

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        """``(F_c + damping I)^-1 (d gamma_c, d beta_c)`` for every channel ``c`` (eigen: ``Q (Q^T v / (d +
        damping))``; inverse: the damped inverses)."""
        if method.name == "eigen":
            q, d = decompositions["q_F"], decompositions["d_F"]
            v = torch.einsum("cji,cj->ci", q, grad.to(q.dtype)) / (d + damping)
            return torch.einsum("cij,cj->ci", q, v)
        inv = decompositions["inv_F"]
        return torch.einsum("cij,cj->ci", inv, grad.to(inv.dtype))

    def precondition_flops(self, method: ComputeMethod) -> int:
        # a k x k block times a k-vector per channel: two of them (Q^T, Q) with eigenpairs, one with the inverse
        return (4 if method.name == "eigen" else 2) * self.g_dim * self.a_dim**2

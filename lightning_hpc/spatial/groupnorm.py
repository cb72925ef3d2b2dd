"""Group, instance and layer normalisation over a spatially split sample: statistics aggregated over the
spatial group, like aggregated batch norm (:mod:`batchnorm`).

``F.group_norm``, ``F.instance_norm`` and ``F.layer_norm`` over the split dimensions all normalise *rows*:
per (sample, group) for group norm, per (sample, channel) for instance norm, per leading index for layer norm,
each row being the rest of the tensor (a part of which lies in every tile).  Viewed as ``(rows, m)`` on each
tile, one kernel serves all three: :class:`_AggregatedRowNorm` computes each tile's per-row mean and (biased)
variance, gathers ``(mean, var, count)`` over the spatial group in one small message and combines them in
float64 with Chan et al.'s pairwise update (no ``E[x^2] - E[x]^2`` cancellation), then normalises the tile.
Its backward all-reduces the two per-row sums ``sum(dy)`` and ``sum(dy * x_hat)`` (the adjoint of the
statistics' reduction).  The affine parameters are applied by the caller with ordinary ops on the tile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["aggregated_row_norm"]


def _combine(
    local_mean: torch.Tensor, local_var: torch.Tensor, m: int, group
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Whole-row mean and biased variance (float64) from every tile's ``(mean, var, count)``: one all-gather."""
    r = local_mean.numel()
    local = torch.cat([local_mean.double(), local_var.double(),
                       torch.tensor([float(m)], dtype=torch.float64, device=local_mean.device)])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    stats = torch.stack(parts)  # (ranks, 2R + 1)
    counts = stats[:, 2 * r : 2 * r + 1]
    n = float(counts.sum())
    # an empty tile contributes count 0 (its mean and variance are NaN): weight it out explicitly
    means = torch.where(counts > 0, stats[:, :r], torch.zeros_like(stats[:, :r]))
    variances = torch.where(counts > 0, stats[:, r : 2 * r], torch.zeros_like(stats[:, :r]))
    mean64 = (means * counts).sum(0) / n
    var64 = ((variances + (means - mean64) ** 2) * counts).sum(0) / n
    return mean64, var64, n


def _sum_over_group(sums: torch.Tensor, group) -> torch.Tensor:
    """The per-row gradient sums of every tile (one all-reduce)."""
    dist.all_reduce(sums, group=group)
    return sums


class _AggregatedRowNorm(torch.autograd.Function):
    """``x_hat = (x - mean) / sqrt(var + eps)`` per row of a ``(rows, m)`` tile view, with the mean and the
    variance of the whole row (every tile of the spatial group).  Saves the input and the per-row statistics.
    Backward: ``dx = rstd * (dy - S_dy / n - x_hat * S_dyxhat / n)`` with the sums over the whole row (one
    all-reduce of ``2 x rows`` values)."""

    @staticmethod
    def forward(ctx, x, eps, group):  # type: ignore[override]
        m = x.shape[1]
        if m > 0:
            var_l, mean_l = torch.var_mean(x, dim=1, correction=0)
        else:
            var_l = mean_l = x.new_zeros(x.shape[0])
        mean64, var64, n = _combine(mean_l, var_l, m, group)
        mean = mean64.to(x.dtype).unsqueeze(1)
        rstd = torch.rsqrt(var64 + eps).to(x.dtype).unsqueeze(1)
        y = (x - mean) * rstd
        ctx.save_for_backward(x, mean, rstd)
        ctx.n, ctx.group = n, group
        ctx.mark_non_differentiable(mean64, var64)
        return y, mean64, var64

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, dy, _dmean, _dvar):  # type: ignore[override]
        x, mean, rstd = ctx.saved_tensors
        x_hat = (x - mean) * rstd
        sums = _sum_over_group(
            torch.stack([dy.sum(1, dtype=torch.float64), (dy * x_hat).sum(1, dtype=torch.float64)]), ctx.group
        )
        s_dy = (sums[0] / ctx.n).to(x.dtype).unsqueeze(1)
        s_dyxhat = (sums[1] / ctx.n).to(x.dtype).unsqueeze(1)
        dx = (dy - s_dy - x_hat * s_dyxhat) * rstd
        return dx, None, None


def aggregated_row_norm(rows: torch.Tensor, eps: float, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise each row of ``rows`` (``(R, m)``, this tile's part of every row) with the statistics of the whole
    row over ``group``.  Returns the normalised tile and the float64 per-row mean and biased variance."""
    y, mean64, var64 = _AggregatedRowNorm.apply(rows, float(eps), group)
    return y, mean64, var64

"""Normalisation over a spatially split sample with statistics aggregated over the spatial group (Dryden et al.,
section III-B: the paper leaves open whether batch statistics are tile-local or aggregated; aggregated ones make
the layer equal to the unpartitioned one).

Batch norm (:func:`aggregated_batch_norm`): per channel, each tile's mean, variance and count are gathered over
the spatial group in one message and combined in float64 (Chan et al.'s pairwise update), so the normalisation,
the gradients and the running statistics (unbiased variance over the whole N x spatial extent) equal those of the
serial layer on the same samples.  Backward all-reduces the two per-channel sums of the output gradient (the
adjoint of the statistics' reduction); weight and bias gradients stay this tile's partial sums, summed over the
group by the caller.

Group, instance and layer norm (:func:`aggregated_row_norm`): ``F.group_norm``, ``F.instance_norm`` and
``F.layer_norm`` over the split dimensions all normalise *rows*: per (sample, group) for group norm, per
(sample, channel) for instance norm, per leading index for layer norm, each row being the rest of the tensor (a
part of which lies in every tile).  Viewed as ``(rows, m)`` on each tile, one kernel serves all three:
:class:`_AggregatedRowNorm` computes each tile's per-row mean and (biased) variance, combines them over the
group like batch norm, then normalises the tile.  Its backward all-reduces the two per-row sums ``sum(dy)`` and
``sum(dy * x_hat)``.  The affine parameters are applied by the caller with ordinary ops on the tile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.layout.op_keys import key_of
from lightning_hpc.spatial.layout.tracing import NotTraceable, Trace, refuse_trace

__all__ = ["aggregated_batch_norm", "aggregated_row_norm"]


def _combine(
    local_mean: torch.Tensor, local_var: torch.Tensor, m: int, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole-row mean and biased variance (float64) from every tile's ``(mean, var, count)``: one all-gather.  The
    whole count is returned as a float64 tensor too: nothing is read back to the host or made from host data, so
    on a GPU the step never waits for the device here (a normalisation layer per synchronisation otherwise)."""
    r = local_mean.numel()
    count = local_mean.new_full((1,), float(m), dtype=torch.float64)  # a fill, not an upload
    local = torch.cat([local_mean.double(), local_var.double(), count])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    stats = torch.stack(parts)  # (ranks, 2R + 1)
    counts = stats[:, 2 * r : 2 * r + 1]
    n = counts.sum()
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
        refuse_trace('a row normalisation (eager form)')
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


def _traced_statistics(x: torch.Tensor, dims: list[int], group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics of :func:`_combine` as a graph can hold them (a traced split step): the whole mean from the
    tiles' float64 sums and counts, then the whole biased variance from each tile's float64 sum of squared
    deviations from that mean (two passes over the tile, no cancellation), each summed over the group by
    ``sum_partial`` of :mod:`~lightning_hpc.spatial.kernels.graph_ops`, whose adjoint sums the tiles' partial gradients
    (the adjoint of the statistics' reduction, as the eager backward's all-reduce).  Differentiable."""
    if x.dtype not in (torch.float32, torch.float64):
        raise NotTraceable(f"a normalisation of {x.dtype} tiles")
    m = x.numel() // max(1, x.shape[1] if dims[0] == 0 else x.shape[0])
    count = x.new_full((1,), float(m), dtype=torch.float64)  # a fill, not an upload
    key = key_of(group)
    total = torch.ops.lightning_hpc.sum_partial(torch.cat([x.sum(dims, dtype=torch.float64), count]), key)
    n = total[-1:]
    mean64 = total[:-1] / n
    shape = [-1 if d not in dims else 1 for d in range(x.dim())]
    dev = x - mean64.to(x.dtype).view(shape)
    var64 = torch.ops.lightning_hpc.sum_partial((dev * dev).sum(dims, dtype=torch.float64), key) / n
    return mean64, var64, n


def aggregated_row_norm(rows: torch.Tensor, eps: float, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise each row of ``rows`` (``(R, m)``, this tile's part of every row) with the statistics of the whole
    row over ``group``.  Returns the normalised tile and the float64 per-row mean and biased variance."""
    if Trace.active:
        mean64, var64, _ = _traced_statistics(rows, [1], group)
        y = (rows - mean64.to(rows.dtype).unsqueeze(1)) * torch.rsqrt(var64 + eps).to(rows.dtype).unsqueeze(1)
        return y, mean64.detach(), var64.detach()
    return _AggregatedRowNorm.apply(rows, float(eps), group)


class _AggregatedBatchNorm(torch.autograd.Function):
    """Batch norm whose statistics cover the whole spatial group, built on PyTorch's fused kernels.

    Forward: per-tile mean and (biased) variance in one pass (the native statistics kernel), combined over the
    group (:func:`_combine`), then the native inference kernel normalises with the group statistics (one pass).
    Saves only the input (like the native layer).  Backward: the native inference backward gives ``dy * gain``
    and the two per-channel tile sums ``sum(dy)``, ``sum(dy * x_hat)`` in one pass; the sums are all-reduced (the
    adjoint of the statistics' reduction) and the statistics' term of the batch-norm backward is subtracted in
    place: ``dx = dy*gain - gain/n * (sum(dy) + x_hat * sum(dy*x_hat))``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):  # type: ignore[override]
        refuse_trace('a batch normalisation (eager form)')
        # the native (Welford) statistics kernel of batch norm: one pass, several times faster than var_mean
        mean_l, var_l = torch.batch_norm_update_stats(x, None, None, 0.0)
        mean64, var64, n = _combine(mean_l, var_l, x.numel() // x.shape[1], group)
        # the native kernel's mixed mode (bf16/fp16 input under autocast, float32 affine parameters) wants the
        # statistics in the parameters' dtype, as the serial layer passes its running statistics
        stat_dtype = weight.dtype if weight is not None else x.dtype
        mean, var = mean64.to(stat_dtype), var64.to(stat_dtype)
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.n, ctx.eps, ctx.group, ctx.has_bias = n, eps, group, bias is not None
        ctx.mark_non_differentiable(mean64, var64, n)
        return y, mean64, var64, n

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, dy, _dmean, _dvar, _dn):  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        dx, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, mean, var, None, None, False, ctx.eps, [True, True, True])
        local = torch.stack([sum_dy, sum_dy_xhat])  # d(bias), d(weight) on this tile
        sums = _sum_over_group(local.clone(), ctx.group)
        invstd = torch.rsqrt(var + ctx.eps)
        gain = invstd if weight is None else invstd * weight
        # dx -= gain/n * (S_dy + (x - mean) * invstd * S_dyxhat) = a * x + b, per channel
        a = gain * invstd * sums[1] / ctx.n
        b = gain * sums[0] / ctx.n - a * mean
        view = (1, -1) + (1,) * (x.dim() - 2)  # N x C x spatial... in 1, 2 or 3 dimensions
        dx.addcmul_(x, a.view(view), value=-1.0).sub_(b.view(view))
        dweight = local[1] if weight is not None else None
        dbias = local[0] if ctx.has_bias else None
        return dx, dweight, dbias, None, None


def aggregated_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                          group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode batch norm of this rank's tile ``x`` (N x C x spatial...) with the statistics of the whole
    sample over ``group``.  Returns the normalised tile, the float64 per-channel mean and biased variance and the
    element count per channel (a float64 tensor on ``x``'s device, for the running statistics' unbiased
    variance)."""
    if Trace.active:
        dims = [0, *range(2, x.dim())]
        mean64, var64, n = _traced_statistics(x, dims, group)
        view = (1, -1) + (1,) * (x.dim() - 2)
        gain = torch.rsqrt(var64 + eps).to(x.dtype)
        if weight is not None:
            gain = gain * weight
        y = (x - mean64.to(x.dtype).view(view)) * gain.view(view)
        if bias is not None:
            y = y + bias.view(view)
        return y, mean64.detach(), var64.detach(), n.detach()
    return _AggregatedBatchNorm.apply(x, weight, bias, float(eps), group)

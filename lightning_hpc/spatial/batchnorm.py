"""BatchNorm2d over a spatially partitioned sample (section III-B).

The paper leaves open whether batch statistics should be tile-local or aggregated over the spatial
distribution of a sample; both are offered.  ``mode="aggregated"`` (the default) gathers, per channel, the
tile's mean, variance and count over the spatial group in one message and combines them in float64 (Chan et
al.'s pairwise update), so the normalisation, the gradients and the running
statistics (unbiased variance over the whole N x H x W) equal those of the unpartitioned layer on the same
samples.  Backward allreduces the two per-channel sums of the output gradient (the adjoint of the statistics'
allreduce); weight and bias gradients stay tile-local partial sums, summed over the group by the strategy.
``mode="local"`` keeps plain ``nn.BatchNorm2d`` on each tile (cheaper, not equal to the serial
layer).  In eval mode the running statistics are used and nothing is communicated.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from lightning_hpc.spatial.layer import SpatialLayer
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialBatchNorm2d", "BN_MODES"]

BN_MODES = ("aggregated", "local")


class _AggregatedBatchNorm(torch.autograd.Function):
    """Batch norm whose statistics cover the whole spatial group, built on PyTorch's fused kernels.

    Forward: per-tile mean and (biased) variance in one pass (the native statistics kernel), one all-gather of
    ``(mean, var, count)``
    per channel over the group, combined in float64 with Chan et al.'s pairwise update (no ``E[x^2] - E[x]^2``
    cancellation), then the native inference kernel normalises with the group statistics (one pass).  Saves
    only the input (like the native layer).  Backward: the native inference backward gives ``dy * gain`` and the
    two per-channel tile sums ``sum(dy)``, ``sum(dy * x_hat)`` in one pass; the sums are allreduced (the adjoint
    of the statistics' reduction) and the statistics' term of Eq. (BN backward) is subtracted in place:
    ``dx = dy*gain - gain/n * (sum(dy) + x_hat * sum(dy*x_hat))``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):  # type: ignore[override]
        c = x.shape[1]
        # the native (Welford) statistics kernel of batch norm: one pass, several times faster than var_mean
        mean_l, var_l = torch.batch_norm_update_stats(x, None, None, 0.0)
        local = torch.cat(
            [
                mean_l.double(),
                var_l.double(),
                torch.tensor([float(x.numel() // c)], dtype=torch.float64, device=x.device),
            ]
        )
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        stats = torch.stack(parts)  # (ranks, 2C + 1)
        counts = stats[:, 2 * c : 2 * c + 1]
        n = float(counts.sum())
        mean64 = (stats[:, :c] * counts).sum(0) / n
        var64 = ((stats[:, c : 2 * c] + (stats[:, :c] - mean64) ** 2) * counts).sum(0) / n
        # the native kernel's mixed mode (bf16/fp16 input under autocast, float32 affine parameters) wants the
        # statistics in the parameters' dtype, as the serial layer passes its running statistics
        stat_dtype = weight.dtype if weight is not None else x.dtype
        mean, var = mean64.to(stat_dtype), var64.to(stat_dtype)
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.n, ctx.eps, ctx.group, ctx.has_bias = n, eps, group, bias is not None
        ctx.mark_non_differentiable(mean64, var64)
        return y, mean64, var64, n

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, dy, _dmean, _dvar, _dn):  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        dx, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, mean, var, None, None, False, ctx.eps, [True, True, True])
        local = torch.stack([sum_dy, sum_dy_xhat])  # d(bias), d(weight) on this tile
        sums = local.clone()
        dist.all_reduce(sums, group=ctx.group)
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


class SpatialBatchNorm2d(nn.BatchNorm2d, SpatialLayer):
    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, grid: SpatialGrid, *, name: str = "") -> SpatialBatchNorm2d:
        new = copy.copy(bn)  # shares weight, bias and the running-stat buffers
        new.__class__ = cls
        assert isinstance(new, cls)
        new._init_spatial(grid, name)
        return new

    def windows(self, h: int, w: int):  # pointwise: any partition with enough rows works
        from lightning_hpc.spatial.halo_exchange import Window1d

        return Window1d(1), Window1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from lightning_hpc.spatial.conv import _is_spatial

        if _is_spatial(x):
            return self.spatial_call(x)
        use_batch_stats = self.training or not self.track_running_stats or self.running_mean is None
        if self._serial_input(x) or not use_batch_stats:
            return super().forward(x)
        self._check_input_dim(x)
        y, mean64, var64, n = _AggregatedBatchNorm.apply(x, self.weight, self.bias, self.eps, self.grid.group)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean64, var64, n)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        assert self.num_batches_tracked is not None  # a buffer whenever running statistics are tracked
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (n / max(n - 1.0, 1.0))
        assert self.running_mean is not None and self.running_var is not None
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

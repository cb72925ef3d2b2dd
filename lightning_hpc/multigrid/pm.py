"""The partitioned-model baseline (the paper's "PM", section IV-D footnote): the same contiguous layer
partition as the multigrid solver, evaluated serially: rank r waits for u_{start} from rank r-1, runs its
steps with ordinary autograd, sends u_{stop} on; the backward pass runs the chain in reverse."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.sharded import LayerShardedTrunk

__all__ = ["PartitionedODEBlock"]


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, block: PartitionedODEBlock, u0: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        x = u0.detach().clone()
        block.chain.recv_prev(x)
        with torch.enable_grad():
            x = x.requires_grad_()
            y = block.local(x)
        block.chain.send_next(y.detach())
        ctx.block, ctx.x, ctx.y = block, x, y
        return block.chain.broadcast(y.detach().clone(), block.chain.last_rank)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        block = ctx.block
        g = grad_out.detach().clone().contiguous()
        block.adjoint_chain.recv_prev(g)
        # frozen parameters (requires_grad=False) are not differentiated: autograd.grad refuses them, and they
        # get no gradient, as in the serial network
        trained = [p for p in block.local_params if p.requires_grad]
        grads = torch.autograd.grad(ctx.y, [ctx.x, *trained], g, allow_unused=True)
        block.adjoint_chain.send_next(grads[0])
        grad_u0 = block.chain.broadcast(grads[0].clone(), block.chain.first_rank)
        ctx.x = ctx.y = None
        of_trained = iter(grads[1:])
        return (None, grad_u0, *(next(of_trained) if p.requires_grad else None for p in block.local_params))


class PartitionedODEBlock(LayerShardedTrunk):
    """Steps split contiguously over the layer group (each rank keeps only its own, sharded.py), evaluated one
    rank after the other."""

    def __init__(self, steps: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(steps, group, 2, 1)
        self.adjoint_chain = LayerChain(group, reverse=True)
        self.local_params = list(self.parameters())

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)  # nn.Sequential over the local steps

    def forward(self, u0: torch.Tensor) -> torch.Tensor:
        return _PipelineFunction.apply(self, u0, *self.local_params)

"""The layer-parallel solver of one rank and the autograd.Function / nn.Module that drop it into a model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.models.ode_resnet import ResidualStep
from lightning_hpc.multigrid.adjoint import AdjointPropagator, parameter_gradients
from lightning_hpc.multigrid.fas import mgrit_solve
from lightning_hpc.multigrid.hierarchy import Hierarchy
from lightning_hpc.multigrid.ode_form import residual_steps
from lightning_hpc.multigrid.options import MultigridOptions
from lightning_hpc.multigrid.parallel import LayerChain
from lightning_hpc.multigrid.partition import LayerPartition
from lightning_hpc.multigrid.propagator import ForwardPropagator
from lightning_hpc.multigrid.sharded import LayerShardedTrunk
from lightning_hpc.multigrid.steps import StepStack

__all__ = ["LayerParallelSolver", "MultigridFunction", "MultigridODEBlock"]


class LayerParallelSolver:
    """Forward (state) and backward (adjoint) multigrid solves over this rank's contiguous share of the steps.

    ``local`` are this rank's steps (``partition.start`` .. ``partition.stop`` of the trunk); ``group`` is the
    layer-parallel process group (None: one process holds all steps).
    """

    def __init__(
        self,
        local: Sequence[ResidualStep],
        partition: LayerPartition,
        options: MultigridOptions,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if len(local) != partition.local_steps:
            raise ValueError(f"rank {partition.rank} owns {partition.local_steps} steps but was given {len(local)}")
        self.options = options
        self.chain = LayerChain(group)
        self.adjoint_chain = LayerChain(group, reverse=True)
        self.partition = partition
        self.stack = StepStack(
            [s.branch for s in local], [s.h for s in local], options.concurrent, first_index=self.partition.start
        )
        self.hierarchy = Hierarchy(self.stack.h, options.cfactor, options.levels)
        #: parameters of the local steps, in the order the gradients come back (step-major, then by name)
        self.local_params = [dict(s.branch.named_parameters())[name] for s in local for name in self.stack.param_names]
        self.forward_history: list[float] = []
        self.backward_history: list[float] = []

    @property
    def local_steps(self) -> int:
        return len(self.stack)

    def solve_states(self, u0: torch.Tensor, training: bool, need_states: bool = True) -> torch.Tensor:
        """States u_{start}..u_{stop} of this rank (``[n + 1, *u0.shape]``), initial guess u_0 everywhere.

        ``need_states=False``: only the last point is valid (inference; saves the last F-relaxation).
        """
        self.stack.refresh(training)
        u = u0.detach().unsqueeze(0).repeat(self.local_steps + 1, *([1] * u0.dim()))
        need_states = need_states or (training and self.stack.has_batch_norm)
        prop = ForwardPropagator(self.stack, self.hierarchy)
        self.forward_history = mgrit_solve(
            prop,
            u,
            self.options.relaxation,
            self.options.forward,
            self.chain,
            need_states,
            self.options.coarse_gather_threshold,
        )
        self.stack.update_running_stats(u[: self.local_steps])
        return u

    def output(self, states: torch.Tensor) -> torch.Tensor:
        """u_N, held by the last rank, on every rank of the group (the closing layers run everywhere)."""
        return self.chain.broadcast(states[-1].clone(), self.chain.last_rank)

    def solve_adjoint(self, states: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(dL/du_0 on every rank, gradients of ``local_params``)."""
        n = self.local_steps
        lam = grad_out.detach().unsqueeze(0).repeat(n + 1, *([1] * grad_out.dim())).contiguous()
        prop = AdjointPropagator(self.stack, self.hierarchy, states)
        self.backward_history = mgrit_solve(
            prop,
            lam,
            self.options.relaxation,
            self.options.backward,
            self.adjoint_chain,
            coarse_gather_threshold=self.options.coarse_gather_threshold,
        )
        stacked = parameter_gradients(self.stack, states, lam)
        grads = [stacked[name][i] for i in range(n) for name in self.stack.param_names]
        grad_u0 = self.chain.broadcast(lam[n].clone(), self.chain.first_rank)
        return grad_u0, grads


class MultigridFunction(torch.autograd.Function):
    """u_N = MG-solve(u_0; theta) with the adjoint multigrid solve as its backward."""

    @staticmethod
    def forward(
        ctx, solver: LayerParallelSolver, training: bool, need_states: bool, u0: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        states = solver.solve_states(u0, training, need_states)
        ctx.solver, ctx.states = solver, states
        return solver.output(states)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        grad_u0, grads = ctx.solver.solve_adjoint(ctx.states, grad_out.contiguous())
        ctx.states = None
        return (None, None, None, grad_u0, *grads)


class MultigridODEBlock(LayerShardedTrunk):
    """Drop-in replacement of a trunk ``nn.Sequential`` of residual steps, solved by layer-parallel multigrid.

    With a layer-parallel ``group`` of P ranks, rank r keeps, computes and updates only steps
    [r N/P, (r+1) N/P), under their original names (sharded.py): its parameters, gradients and optimizer state
    are those of its own steps, as in the paper's model parallelism.  :meth:`full_state_dict` /
    :func:`full_model_state_dict` gather the whole trunk for checkpoints; loading a full state dict keeps the
    local steps' entries.  With no group it holds every step (one process).
    """

    def __init__(
        self, steps: nn.Module, options: MultigridOptions | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        options = options or MultigridOptions()
        super().__init__(steps, group, options.cfactor, options.levels)
        self.options = options
        self.solver = LayerParallelSolver(self.local_blocks, self.partition, self.options, group)
        self._shape_checked = False

    @property
    def forward_history(self) -> list[float]:
        """||R_h|| per cycle of the last forward solve."""
        return self.solver.forward_history

    @property
    def backward_history(self) -> list[float]:
        """||R_h|| per cycle of the last adjoint solve."""
        return self.solver.backward_history

    def forward(self, u0: torch.Tensor) -> torch.Tensor:
        if not self._shape_checked:  # local steps only: each rank checks its own share once
            residual_steps(nn.Sequential(*self.local_blocks), u0[:1].detach(), first_index=self.partition.start)
            self._shape_checked = True
        need_states = torch.is_grad_enabled() and (
            u0.requires_grad or any(p.requires_grad for p in self.solver.local_params)
        )
        return MultigridFunction.apply(self.solver, self.training, need_states, u0, *self.solver.local_params)

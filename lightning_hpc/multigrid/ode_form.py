"""The ODE form multigrid needs (Kirby et al., Eq. (1)): a trunk of forward-Euler residual steps
``u_{n+1} = u_n + h F(u_n; theta_n)`` with equal state shapes; :func:`residual_steps` checks a model's trunk and
explains, naming the first block, when it does not fit.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lightning_hpc.models.ode_resnet import ResidualStep

__all__ = ["NotResidualError", "residual_steps"]


class NotResidualError(ValueError):
    """A module that should be a sequence of residual steps ``u + h F(u)`` is not one."""



def _describe(module: nn.Module) -> str:
    text = repr(module).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def residual_steps(
    steps: nn.Module, example_state: torch.Tensor | None = None, first_index: int = 0
) -> list[ResidualStep]:
    """Check that ``steps`` is a sequence of residual steps ``u + h F(u)`` with equal state shapes.

    Accepts an ``nn.Sequential`` (or ``nn.ModuleList``) whose children are :class:`ResidualStep` (or any module
    with a ``branch`` module and a positive float ``h``, the same form).  With ``example_state`` (one sample
    or a batch of the state u_0), every step is run once to check that it keeps the state's shape.  Raises
    :class:`NotResidualError` naming the first block that breaks the form (blocks are numbered from
    ``first_index``, for a share of a longer trunk).
    """
    if not isinstance(steps, (nn.Sequential, nn.ModuleList)):
        raise NotResidualError(
            f"the residual trunk must be an nn.Sequential of residual steps, got {type(steps).__name__}; "
            "build the model with lightning_hpc.models.ode_resnet or wrap each block as ResidualStep(branch, h)"
        )
    blocks = list(steps)
    if not blocks:
        raise NotResidualError("the residual trunk is empty: it needs at least one residual step")
    for i, block in enumerate(blocks):
        branch, h = getattr(block, "branch", None), getattr(block, "h", None)
        if not isinstance(branch, nn.Module) or not isinstance(h, (int, float)) or not h > 0:
            raise NotResidualError(
                f"block {first_index + i} ({_describe(block)}) is not a residual step u + h F(u): multigrid needs "
                "every block of "
                "the trunk in forward-Euler form; wrap its residual branch as ResidualStep(branch, h)"
            )
        if type(block).forward is not ResidualStep.forward:
            # The solver evaluates u + h * branch(u) and never calls the block's forward, so a block is accepted
            # only when its forward is provably that expression: ResidualStep's own (a subclass must not
            # override it).  Attributes named `branch` and `h` alone prove nothing about what forward computes.
            raise NotResidualError(
                f"block {first_index + i} ({_describe(block)}) has `branch` and `h` but its own forward(), which "
                "the multigrid "
                "solver would never call (it evaluates u + h * branch(u) itself): if that forward computes exactly "
                "u + h * branch(u), build the block as lightning_hpc.models.ResidualStep(branch, h); otherwise use "
                "strategy='ddp'"
            )
    if example_state is not None:
        u = example_state
        with torch.no_grad():
            for i, block in enumerate(blocks):
                was_training = block.training
                block.eval()  # no running-statistics updates from a shape check
                try:
                    v = cast(nn.Module, block.branch)(u)  # checked above: a module
                finally:
                    block.train(was_training)
                if v.shape != u.shape:
                    raise NotResidualError(
                        f"block {first_index + i} ({_describe(block)}) maps a state of shape {tuple(u.shape)} to "
                        f"{tuple(v.shape)}: "
                        "every residual step must keep the state's shape (use 'same' padding, no stride, no "
                        "channel change inside the trunk; move shape changes to the opening or closing layers)"
                    )
                u = u + block.h * v
    return blocks  # type: ignore[return-value]

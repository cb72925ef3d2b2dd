"""Code compiled before K-FAC registered its hooks runs without them (torch.compile reuses code compiled for the
same module class, and does not guard it on hooks added to another instance): K-FAC then sees no statistics at
all and refuses at its first factor step, before the optimizer updates anything, naming the fix."""

import pytest
import torch
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).relu().flatten(1))


def _train_step(model: nn.Module, pre: KFACPreconditioner, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    torch.compile(model, backend="eager")(x).square().mean().backward()
    pre.step()
    opt.step()


def test_code_compiled_without_the_hooks_is_refused_and_reset_fixes_it():
    torch._dynamo.reset()
    x = torch.randn(4, 1, 8, 8)
    torch.compile(_Net(), backend="eager")(x).sum().backward()  # the class compiled once without K-FAC

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, announce=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"none of the hooks of the 2 layers.*torch\._dynamo\.reset\(\)"):
        _train_step(model, pre, opt, x)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # refused before any update

    torch._dynamo.reset()  # the fix the message names: the hooks fire and both layers are preconditioned
    pre.discard_statistics()
    _train_step(model, pre, opt, x)
    assert {name for name, *_ in pre.preconditioned_modules} == {"conv", "fc"}
    assert set(pre.factors) == {"conv", "fc"}
    torch._dynamo.reset()

"""Training a deep ODE-ResNet on digits with 2 forward (and 2 adjoint) cycles matches serial training."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_hpc.data.digits import load_digits_tensors
from lightning_hpc.models import ode_resnet
from lightning_hpc.multigrid import MultigridODEBlock, MultigridOptions, SolveSettings


def train(net, epochs: int, lr: float = 0.05, batch: int = 64, seed: int = 0) -> float:
    train_set, val_set = load_digits_tensors(0.2, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    x_all, y_all = train_set.tensors
    for _ in range(epochs):
        perm = torch.randperm(len(x_all), generator=g)
        for i in range(0, len(perm), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            F.cross_entropy(net(x_all[idx]), y_all[idx]).backward()
            opt.step()
    x_val, y_val = val_set.tensors
    with torch.no_grad():
        return float((net(x_val).argmax(1) == y_val).float().mean())


def compare(num_steps: int, epochs: int, options: MultigridOptions) -> tuple[float, float]:
    torch.manual_seed(0)
    serial = ode_resnet(1, 10, 8, width=8, num_steps=num_steps, final_time=2.0)
    mg = copy.deepcopy(serial)
    mg.steps = MultigridODEBlock(mg.steps, options)
    return train(serial, epochs), train(mg, epochs)


TWO_CYCLES = MultigridOptions(cfactor=4, levels=2, relaxation="F", forward=SolveSettings(2), backward=SolveSettings(2))


def test_two_cycle_training_matches_serial_short(capsys):
    acc_serial, acc_mg = compare(num_steps=16, epochs=3, options=TWO_CYCLES)
    with capsys.disabled():
        print(f"\ndigits, 16 steps, 3 epochs: serial {acc_serial:.4f}  multigrid (2 cycles) {acc_mg:.4f}")
    assert acc_serial > 0.85  # it learned: a broken gradient would not get here in 3 epochs
    assert abs(acc_mg - acc_serial) <= 0.01


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_two_cycle_training_matches_serial_deep(capsys):
    options = MultigridOptions(cfactor=4, levels=3, relaxation="F", forward=SolveSettings(2), backward=SolveSettings(2))
    acc_serial, acc_mg = compare(num_steps=64, epochs=6, options=options)
    with capsys.disabled():
        print(f"\ndigits, 64 steps, 6 epochs: serial {acc_serial:.4f}  multigrid (2 cycles) {acc_mg:.4f}")
    assert acc_serial > 0.95
    assert abs(acc_mg - acc_serial) <= 0.01
